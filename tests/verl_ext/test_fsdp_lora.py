"""LoRA in verl's real FSDP engine (``model.lora_rank``, ``lora_alpha``, ``target_modules``,
``lora_adapter_path``) with ``prefix_grouper`` on gives what the same engine gives with it off
(whichever supported verl is installed: 0.9.1 or 0.8.0).

verl switches the HF model to the sharing attention in ``_build_module``, then wraps it with
PEFT (``_build_lora_module``) and FSDP2. Compared, fp32 within 1e-5: the actor's old log-probs
and entropy (``infer_batch``), the reference's - the actor with its adapters disabled
(``engine.disable_adapter()``, as verl's worker runs the reference of a LoRA actor) -, verl's
``ppo_loss`` and every LoRA gradient (``forward_backward_batch``). The adapter loaded from
``lora_adapter_path`` is drawn at random (PEFT's default zero ``B`` would be a no-op and give
zero ``A`` gradients); a control shows it changes the log-probs. A freshly initialised adapter
(``lora_rank`` / ``lora_alpha`` / ``target_modules``) is compared the same way.
"""

import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._batch import PRESET, make_batch, plain_output, use_cpu_platform  # noqa: E402
from tests.verl_ext._compare import MODES, close, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import (actor_config, build_engine,  # noqa: E402
                                         count_sharing_attention, save_model)

SETTINGS = {"off": None, "shared": MODES["arbitrary_prefix"]}
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def lora_runs(rank: int, path: str, lora: dict, workload: str) -> dict:
    """Per sharing setting, on a fresh engine with the LoRA fields ``lora``: the actor's and
    the reference's ``infer_batch`` outputs, ``forward_backward_batch``'s and every gradient."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.verl_ext.mcore import prompt_lengths

    use_cpu_platform()

    def batch():
        data = make_batch(workload, seed=rank)
        tu.assign_non_tensor(data, use_remove_padding=True)
        return data

    results = {}
    for name, prefix_grouper in SETTINGS.items():
        config = actor_config(prefix_grouper)
        torch.manual_seed(0)  # a fresh adapter's A is drawn at random: the same in both engines
        engine = build_engine(config, path, **lora)
        with count_sharing_attention() as calls:
            with engine.eval_mode():
                infer = engine.infer_batch(batch())
                with engine.disable_adapter():
                    reference = engine.infer_batch(batch())
            with engine.train_mode():
                train = engine.forward_backward_batch(batch(), partial(ppo_loss, config=config))
                grads = full_gradients(engine.module)
        results[name] = {"infer": plain_output(infer), "reference": plain_output(reference),
                         "train": plain_output(train), "grads": grads,
                         "attention_calls": calls["n"], "engine": type(engine).__name__,
                         # the sharing head scores verl's read window only (_compare.same_outputs)
                         "read_from": [n - 1 for n in prompt_lengths(batch())]}
    return results


def save_random_adapter(base: str, directory: str) -> str:
    """A PEFT LoRA adapter (rank 4, on :data:`TARGETS`) with random ``A`` and ``B``."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_model(str(tmp_path_factory.mktemp("qwen2")))


def both_adapters(rank: int, path: str, adapter: str) -> dict:
    """The loaded adapter on the tree batch, a fresh one on the GRPO batch (one spawned rank)."""
    return {
        "loaded": lora_runs(rank, path, dict(lora_rank=4, lora_alpha=8,
                                             lora_adapter_path=adapter), "tree"),
        "fresh": lora_runs(rank, path, dict(lora_rank=8, lora_alpha=16,
                                            target_modules=TARGETS), "grpo"),
    }


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    adapter = save_random_adapter(checkpoint, str(tmp_path_factory.mktemp("adapter")))
    return run_gloo(both_adapters, 1, checkpoint, adapter, timeout=400)[0]


@pytest.fixture
def loaded(runs):
    return runs["loaded"]


@pytest.fixture
def fresh(runs):
    return runs["fresh"]


def _same_references(shared: dict, plain: dict, where: str) -> None:
    for key in ("log_probs", "entropy"):
        pairs = zip(shared["reference"]["model_output"][key],
                    plain["reference"]["model_output"][key], strict=True)
        for i, (s, p) in enumerate(pairs):
            start, upto = shared["read_from"][i], -1 if key == "log_probs" else None
            close(s[start:upto], p[start:upto], f"{where} reference {key}[{i}]")


def test_a_loaded_adapter_matches_the_feature_off_actor_reference_loss_and_lora_gradients(loaded):
    shared, plain = loaded["shared"], loaded["off"]
    assert plain["grads"] and all("lora_" in name for name in plain["grads"])
    assert len(plain["grads"]) == 2 * len(TARGETS) * PRESET.num_layers  # every A and B
    same_outputs(shared, plain, "loaded adapter")
    _same_references(shared, plain, "loaded adapter")
    assert shared["attention_calls"] > 0 and plain["attention_calls"] == 0
    assert shared["engine"] == "PrefixSharingFSDPEngine"
    metrics = shared["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]


def test_the_adapter_changes_the_log_probs_so_the_reference_comparison_is_not_vacuous(loaded):
    import torch

    actor = loaded["off"]["infer"]["model_output"]["log_probs"]
    reference = loaded["off"]["reference"]["model_output"]["log_probs"]
    gap = max(float((a[:-1] - r[:-1]).abs().max()) for a, r in zip(actor, reference))
    scale = max(float(r[:-1].abs().max()) for r in reference)
    assert gap > 1e-3 * scale, gap
    assert all(torch.count_nonzero(g) for g in loaded["off"]["grads"].values())


def test_a_fresh_adapter_from_lora_rank_and_target_modules_matches_the_feature_off(fresh):
    same_outputs(fresh["shared"], fresh["off"], "fresh adapter")
    _same_references(fresh["shared"], fresh["off"], "fresh adapter")
    assert {name.split(".")[-3] for name in fresh["off"]["grads"]} == {"lora_A", "lora_B"}
    assert fresh["shared"]["attention_calls"] > 0
