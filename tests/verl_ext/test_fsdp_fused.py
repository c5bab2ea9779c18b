"""verl's FSDP engine with sharing, under verl's log-prob switches, gives verl's stock results
with the same switches (whichever supported verl is installed: 0.9.1 or 0.8.0).

With sharing on, the engine's model returns log-probs and entropy computed from its hidden
states in chunks of rows (:mod:`prefix_sharing.head_logprobs`), the read window only. Compared
with verl's stock engine on the same checkpoint, fp32 within 1e-5 (``_compare``): old
log-probs and entropy (``infer_batch``), verl's ``ppo_loss`` and every gradient
(``forward_backward_batch``), on GRPO and tree batches, one rank:

- ``use_fused_kernels: true`` (``fused_kernel_options.impl_backend: torch``): verl's own fused
  forward (``FusedLinearForPPO``) against the sharing head;
- ``entropy_from_logits_with_chunking`` and ``entropy_checkpointing`` on;
- ``calculate_entropy`` off (no entropy returned, no entropy term in the loss);
- ``use_torch_compile`` (on by default; off in the other runs, as inductor is slow on CPU): the
  sharing engine never calls verl's compiled entropy function, and its outputs are bitwise
  those with the switch off.

The model's LM head never builds the flat logits on the sharing side (a spy on the head's
``forward``, which the chunked head never calls).
"""

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

import dataclasses  # noqa: E402

import torch  # noqa: E402
from verl.workers.config import FSDPEngineConfig  # noqa: E402

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import save_model  # noqa: E402

SHARED = MODES["arbitrary_prefix"]
FUSED = dict(model=dict(use_fused_kernels=True, fused_kernel_options={"impl_backend": "torch"}),
             engine=dict(use_fused_kernels=True), batch=dict(use_fused_kernels=True))
KNOBS = dict(engine=dict(entropy_from_logits_with_chunking=True, entropy_checkpointing=True))
if "entropy_from_logits_chunk_size" in {f.name for f in dataclasses.fields(FSDPEngineConfig)}:
    KNOBS["engine"]["entropy_from_logits_chunk_size"] = 7  # verl 0.9.1: chunks that do not divide
NO_ENTROPY = dict(batch=dict(calculate_entropy=False))
COMPILED = dict(engine=dict(use_torch_compile=True))
# (name, prefix_grouper, switches)
RUNS = [(f"{switch}/{side}", grouper, settings)
        for switch, settings in (("fused", FUSED), ("knobs", KNOBS), ("no_entropy", NO_ENTROPY))
        for side, grouper in (("off", None), ("shared", SHARED))]
RUNS.append(("compiled/shared", SHARED, {**COMPILED, "engine": {**KNOBS["engine"],
                                                                 **COMPILED["engine"]}}))
WORKLOADS = ("grpo", "tree")


def one_run(path: str, workload: str, prefix_grouper: dict | None, switches: dict) -> dict:
    """``infer_batch`` and ``forward_backward_batch`` (verl's ``ppo_loss``) of a fresh engine
    with ``switches`` (engine-config, model-config and batch keys); every gradient; how often
    the LM head's own forward and verl's compiled entropy function ran; each sample's first
    read position."""
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.verl_ext.mcore import prompt_lengths
    from tests.verl_ext._batch import make_batch, plain_output
    from tests.verl_ext._fsdp_engine import actor_config, build_engine

    config = actor_config(prefix_grouper, **switches.get("engine", {}))
    engine = build_engine(config, path, **switches.get("model", {}))
    calls = {"head": 0, "entropy": 0}  # "head": (T_flat, vocab) logits the LM head built
    head = engine.module.get_output_embeddings()
    head.register_forward_hook(lambda _m, _a, out: calls.__setitem__(
        "head", calls["head"] + isinstance(out, torch.Tensor)))
    entropy_fn = engine.compute_entropy_from_logits

    def counted_entropy(*args: Any, **kwargs: Any):
        calls["entropy"] += 1
        return entropy_fn(*args, **kwargs)

    engine.compute_entropy_from_logits = counted_entropy

    def batch():
        data = make_batch(workload)
        data.pop("temperature")  # verl's fused kernels take one temperature per batch
        tu.assign_non_tensor_data(data, "temperature", 0.9)
        tu.assign_non_tensor(data, **switches.get("batch", {}))
        return data

    with engine.eval_mode():
        infer = engine.infer_batch(batch())
    with engine.train_mode():  # zeroes the gradients on exit: gather them before
        train = engine.forward_backward_batch(batch(), partial(ppo_loss, config=config))
        grads = full_gradients(engine.module)
    return {"infer": plain_output(infer), "train": plain_output(train), "grads": grads,
            "calls": calls, "read_from": [n - 1 for n in prompt_lengths(batch())]}


def all_runs(rank: int, paths: dict[str, str]) -> dict:
    """Every run, each on a fresh engine; Qwen2's class forward is put back after each (verl's
    ``use_fused_kernels`` replaces it class-wide, for every later model in the process)."""
    from transformers import Qwen2ForCausalLM

    from tests.verl_ext._batch import use_cpu_platform

    use_cpu_platform()
    stock_forward = Qwen2ForCausalLM.forward
    results = {}
    for workload in WORKLOADS:
        for name, grouper, switches in RUNS:
            path = paths["tied" if name.startswith("fused") else "untied"]
            try:
                results[workload, name] = one_run(path, workload, grouper, switches)
            finally:
                Qwen2ForCausalLM.forward = stock_forward
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fused runs on a tied-embedding Qwen2: with an untied head verl 0.9.1 puts
    ``lm_head`` in its own FSDP2 unit, and its own fused forward then reads the sharded weight
    (``aten.mm ... mixed torch.Tensor and DTensor``); the sharing head runs under that unit
    (the other runs, untied)."""
    import dataclasses

    from tests.verl_ext._batch import PRESET

    paths = {"untied": save_model(str(tmp_path_factory.mktemp("untied"))),
             "tied": save_model(str(tmp_path_factory.mktemp("tied")),
                                preset=dataclasses.replace(PRESET, tie_embeddings=True))}
    return run_gloo(all_runs, 1, paths, timeout=500)[0]


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("switch", ["fused", "knobs", "no_entropy"])
def test_sharing_gives_the_stock_results_under_the_switch(runs, workload, switch):
    shared, stock = runs[workload, f"{switch}/shared"], runs[workload, f"{switch}/off"]
    same_outputs(shared, stock, f"{workload} {switch}")
    assert shared["calls"]["head"] == 0  # the sharing side never built the logits
    if switch == "fused":  # verl's fused forward does not call the head module either
        assert stock["calls"]["head"] == 0
    else:
        assert stock["calls"]["head"] > 0


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_read_window_is_compared_and_the_prompt_rows_are_not_scored(runs, workload):
    """Every sample's prompt positions before its last one are 0 on the sharing side (the
    comparison above starts at the read window); the window is not empty."""
    shared = runs[workload, "knobs/shared"]
    for values, start in zip(shared["infer"]["model_output"]["log_probs"], shared["read_from"]):
        assert start > 0 and len(values) - 1 > start
        assert values[:start].eq(0).all() and values[start:-1].ne(0).all()


def test_entropy_off_returns_no_entropy(runs):
    for workload in WORKLOADS:
        for side in ("off", "shared"):
            assert "entropy" not in runs[workload, f"no_entropy/{side}"]["infer"]["model_output"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_use_torch_compile_changes_nothing_with_sharing(runs, workload):
    """verl's compiled entropy function is never called with sharing on (the stock path with
    the knobs calls it), and the outputs are bitwise those with the switch off."""
    compiled, eager = runs[workload, "compiled/shared"], runs[workload, "knobs/shared"]
    assert compiled["calls"]["entropy"] == 0 and eager["calls"]["entropy"] == 0
    assert runs[workload, "knobs/off"]["calls"]["entropy"] > 0
    for key in ("log_probs", "entropy"):
        for a, b in zip(compiled["infer"]["model_output"][key],
                        eager["infer"]["model_output"][key], strict=True):
            assert torch.equal(a, b)
    assert compiled["train"]["loss"] == eager["train"]["loss"]
    assert all(torch.equal(compiled["grads"][k], g) for k, g in eager["grads"].items())
