"""verl's SFT step on the sharing engines equals verl's stock SFT step.

verl's SFT trainer (``verl/trainer/sft_trainer.py``) builds its engine from its ``engine``
section through the same registry as the actor and runs ``forward_backward_batch`` with
``sft_loss`` (log-probs summed over the left-shifted ``loss_mask``, over the global token
count) on the no-padding batch its collator makes (nested ``input_ids`` / ``position_ids`` /
``loss_mask``, no ``responses``, no ``uid``). Here the engine config comes from an SFT engine
section with ``use_prefix_grouper`` / ``prefix_grouper`` in it (the switch under test), the
batch is multi-turn conversations sharing a system prompt plus one conversation's turn-level
samples (each a strict prefix of the next), and the comparison is the step's loss, every
gradient and the log-probs of every position (``infer_batch``, as the trainer's validation
calls it), fp32 within 1e-5: the FSDP engine (FSDP2, verl 0.9.1 and 0.8.0) and the Megatron
engine (TP=1, verl 0.9.1: ``tests/verl_ext/_engine.py``'s injected model). Control: the same
run with the keys absent computes every token (token ratio 1, no sharing attention call).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import save_model  # noqa: E402

MODES = {"off": None, "arbitrary_prefix": {"mode": "arbitrary_prefix"}}
SYSTEM = 40  # the shared system prompt's tokens


def sft_batch(seed: int = 0, vocab_size: int = 512):
    """A batch as verl's SFT trainer hands it to its worker: ``SFTTensorCollator`` (no padding)
    over 4 conversations opening with one system prompt (user / assistant turns of their own,
    the assistant's tokens in ``loss_mask``) and 2 turn-level samples of a fifth (the shorter
    a strict prefix of the longer), then the trainer's ``meta_info`` (micro-batches of 2)."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    rng = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, vocab_size, (n,), generator=rng)

    system = tokens(SYSTEM)

    def conversation(turns):
        ids, mask = [system], [torch.zeros(SYSTEM, dtype=torch.long)]
        for user, assistant in turns:
            ids += [tokens(user), tokens(assistant)]
            mask += [torch.zeros(user, dtype=torch.long), torch.ones(assistant, dtype=torch.long)]
        return torch.cat(ids), torch.cat(mask)

    samples = [conversation([(6 + i, 5 + i), (4, 3 + i)]) for i in range(4)]
    chain = conversation([(7, 5), (5, 6)])
    first_turn = SYSTEM + 7 + 5
    samples += [(chain[0][:first_turn], chain[1][:first_turn]), chain]
    data = SFTTensorCollator("no_padding")(
        [{"input_ids": ids, "loss_mask": mask, "position_ids": torch.arange(len(ids))}
         for ids, mask in samples])
    meta_info = {"use_remove_padding": True, "use_dynamic_bsz": False,
                 "max_token_len_per_gpu": 8192, "micro_batch_size_per_gpu": 2,
                 "temperature": 1.0, "global_batch_size": len(samples),
                 "pad_mode": "no_padding", "pad_token_id": 0}
    batch = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta_info)
    tu.assign_non_tensor(batch, use_fused_kernels=False)
    return batch


def sft_engine_config(target: str, prefix_grouper: dict | None, **fields):
    """The SFT trainer's ``engine`` section through verl's conversion, with the sharing keys
    in it when ``prefix_grouper`` is given; what verl's worker then sets from the model and
    data sections."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = dict(_target_=target, **fields)
    if prefix_grouper is not None:
        section.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(section))
    config.use_remove_padding = True
    config.use_dynamic_bsz = False
    config.micro_batch_size_per_gpu = 2
    return config


def sft_loss():
    """verl's SFT loss as its trainer binds it."""
    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)


def step_output(infer, train, grads) -> dict:
    from tests.verl_ext._batch import plain_output

    return {"infer": plain_output(infer), "train": plain_output(train), "grads": grads}


def fsdp_steps(rank: int, path: str) -> dict:
    """The FSDP2 engine verl selects, built from the SFT engine section and the checkpoint at
    ``path``, per mode."""
    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from tests.verl_ext._batch import use_cpu_platform
    from tests.verl_ext._fsdp_engine import (FP32, actor_config, build_engine,
                                             count_sharing_attention)

    use_cpu_platform()
    results = {}
    for name, prefix_grouper in MODES.items():
        stock = actor_config(None)  # its optimizer and checkpoint sections
        engine_config = sft_engine_config("verl.workers.config.FSDPEngineConfig", prefix_grouper,
                                          strategy="fsdp2", mixed_precision=FP32,
                                          use_torch_compile=False)
        config = SimpleNamespace(strategy="fsdp2", engine=engine_config, optim=stock.optim,
                                 checkpoint=stock.checkpoint)
        engine = build_engine(config, path)
        with count_sharing_attention() as calls:
            with engine.eval_mode():  # the log-probs of every position, as validation asks
                infer = engine.infer_batch(sft_batch(), loss_function=sft_loss())
            with engine.train_mode():  # zeroes the gradients on exit: gather them before
                train = engine.forward_backward_batch(sft_batch(), sft_loss())
                results[name] = step_output(infer, train, full_gradients(engine.module))
        results[name]["attention_calls"] = calls["n"]
    results["prompt_only"] = prompt_only_refusal(path)
    return results


def prompt_only_refusal(path: str) -> list[str]:
    """The refusal keys ``prompt_only`` (``use_prefix_grouper`` without a mode) meets at the
    first SFT micro-batch: SFT samples carry no uid."""
    from prefix_sharing.errors import PrefixSharingSetupError
    from tests.verl_ext._fsdp_engine import FP32, actor_config, build_engine

    stock = actor_config(None)
    engine_config = sft_engine_config("verl.workers.config.FSDPEngineConfig",
                                      {"mode": "prompt_only"}, strategy="fsdp2",
                                      mixed_precision=FP32, use_torch_compile=False)
    engine = build_engine(SimpleNamespace(strategy="fsdp2", engine=engine_config,
                                          optim=stock.optim, checkpoint=stock.checkpoint), path)
    try:
        with engine.eval_mode():
            engine.infer_batch(sft_batch(), loss_function=sft_loss())
    except PrefixSharingSetupError as error:
        return [found.key for found in error.found]
    return []


def megatron_steps(rank: int) -> dict:
    """The Megatron engine verl selects, built from the SFT engine section, tiny GPTModel
    injected (``_engine.build_engine``), per mode."""
    from tests.verl_ext._batch import use_cpu_platform
    from tests.verl_ext._engine import actor_config, build_engine

    use_cpu_platform()
    results = {}
    for name, prefix_grouper in MODES.items():
        stock = actor_config(None)
        engine_config = sft_engine_config("verl.workers.config.McoreEngineConfig",
                                          prefix_grouper, use_mbridge=True, vanilla_mbridge=True)
        engine = build_engine(SimpleNamespace(engine=engine_config, optim=stock.optim,
                                              checkpoint=stock.checkpoint))
        infer = engine.infer_batch(sft_batch(), loss_function=sft_loss())
        train = engine.forward_backward_batch(sft_batch(), sft_loss())
        results[name] = step_output(infer, train, {
            n: p.grad.clone() for n, p in engine.module[0].named_parameters()})
    return results


def sft_steps(rank: int, path: str) -> dict:
    """Both engines in one spawned process (megatron's parallel state at TP=1 is set up by
    ``run_distributed``; the FSDP engine takes the same one-rank gloo group); the Megatron
    harness (``_engine.py``) is verl 0.9.1's."""
    from importlib.metadata import version

    return {"fsdp": fsdp_steps(rank, path),
            "megatron": megatron_steps(rank) if version("verl") == "0.9.1" else None}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from prefix_sharing.engines.launch import run_distributed

    return run_distributed(sft_steps, 1, save_model(str(tmp_path_factory.mktemp("qwen2"))),
                           timeout=400)[0]


def assert_equal_to_stock_and_shared(results, where):
    shared, plain = results["arbitrary_prefix"], results["off"]
    same_outputs(shared, plain, where)
    assert all(loss != 0 for loss in plain["train"]["loss"])  # the loss mask selects tokens
    metrics = shared["train"]["metrics"]
    total = metrics["prefix_sharing/tokens_total"][0]
    computed = metrics["prefix_sharing/tokens_computed"][0]
    # the system prompt once per micro-batch of 2 conversations, the chain's first turn once
    assert total - computed >= SYSTEM * 3
    assert metrics["prefix_sharing/token_ratio"][0] == pytest.approx(total / computed)
    assert not any(key.startswith("prefix_sharing/") for key in plain["train"]["metrics"])


def test_fsdp_sft_step_equals_verls_stock_step(results):
    fsdp = results["fsdp"]
    assert_equal_to_stock_and_shared(fsdp, "fsdp2 sft")
    assert fsdp["arbitrary_prefix"]["attention_calls"] > 0 == fsdp["off"]["attention_calls"]


def test_prompt_only_is_refused_on_sft_samples_which_carry_no_uid(results):
    assert results["fsdp"]["prompt_only"] == ["verl.prompt_uids"]


def test_megatron_sft_step_equals_verls_stock_step(results):
    if results["megatron"] is None:
        pytest.skip("the in-process Megatron harness (tests/verl_ext/_engine.py) is verl 0.9.1's")
    assert_equal_to_stock_and_shared(results["megatron"], "megatron tp1 sft")
