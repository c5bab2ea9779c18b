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
calls it), fp32 within 1e-5: the FSDP engine (FSDP2) and the Megatron engine (TP=1,
``tests/verl_ext/_engine.py``'s injected model; also with an MTP layer trained, as MiMo's SFT
recipe does, its logged loss compared), verl 0.9.1 and 0.8.0. Control: the same
run with the keys absent computes every token (token ratio 1, no sharing attention call).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import save_model  # noqa: E402
from tests.verl_ext._sft import (SYSTEM, fsdp_sft_config, fsdp_sft_step, sft_batch,  # noqa: E402
                                 sft_engine_config, sft_loss, step_output)

MODES = {"off": None, "arbitrary_prefix": {"mode": "arbitrary_prefix"}}


def fsdp_steps(rank: int, path: str) -> dict:
    """The FSDP2 engine verl selects, built from the SFT engine section and the checkpoint at
    ``path``, per mode."""
    from tests.verl_ext._batch import use_cpu_platform
    from tests.verl_ext._fsdp_engine import build_engine, count_sharing_attention

    use_cpu_platform()
    results = {}
    for name, prefix_grouper in MODES.items():
        engine = build_engine(fsdp_sft_config(prefix_grouper), path)
        with count_sharing_attention() as calls:
            results[name] = fsdp_sft_step(engine)
        results[name]["attention_calls"] = calls["n"]
    results["prompt_only"] = prompt_only_refusal(path)
    return results


def prompt_only_refusal(path: str) -> list[str]:
    """The refusal keys ``prompt_only`` (``use_prefix_grouper`` without a mode) meets at the
    first SFT micro-batch: SFT samples carry no uid."""
    from prefix_sharing.errors import PrefixSharingSetupError
    from tests.verl_ext._fsdp_engine import build_engine

    engine = build_engine(fsdp_sft_config({"mode": "prompt_only"}), path)
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
    for mtp in (False, True):  # MiMo's SFT recipe trains one MTP layer (model.mtp)
        model = dict(mtp=SimpleNamespace(enable=True, enable_train=True, detach_encoder=False),
                     mtp_num_layers=1) if mtp else {}
        for name, prefix_grouper in MODES.items():
            stock = actor_config(None)
            engine_config = sft_engine_config("verl.workers.config.McoreEngineConfig",
                                              prefix_grouper, use_mbridge=True,
                                              vanilla_mbridge=True)
            engine = build_engine(SimpleNamespace(engine=engine_config, optim=stock.optim,
                                                  checkpoint=stock.checkpoint), **model)
            infer = engine.infer_batch(sft_batch(), loss_function=sft_loss())
            train = engine.forward_backward_batch(sft_batch(), sft_loss())
            results[name, mtp] = step_output(infer, train, {
                n: p.grad.clone() for n, p in engine.module[0].named_parameters()})
    return results


def sft_steps(rank: int, path: str) -> dict:
    """Both engines in one spawned process (megatron's parallel state at TP=1 is set up by
    ``run_distributed``; the FSDP engine takes the same one-rank gloo group)."""
    return {"fsdp": fsdp_steps(rank, path),
            "megatron": megatron_steps(rank)}


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


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_megatron_sft_step_equals_verls_stock_step(results, mtp):
    runs = {name: results["megatron"][name, mtp] for name in MODES}
    assert_equal_to_stock_and_shared(runs, "megatron tp1 sft" + " mtp" * mtp)
    if mtp:
        assert any(name.startswith("mtp.") for name in runs["off"]["grads"])
        metrics = {k: v for k, v in runs["off"]["train"]["metrics"].items()
                   if k.startswith("mtp_losses/")}
        assert metrics and all(runs["arbitrary_prefix"]["train"]["metrics"][k] == pytest.approx(
            v, rel=1e-5) for k, v in metrics.items())
