"""Groups that nest inside verl's real Megatron engine (whichever supported verl is installed):
a common prefix longer than half the budget - longer than the budget itself - computed in
chunks, and a two-level tree whose branches do not fit beside their shared part, each shared
part computed once (:mod:`prefix_sharing.verl_ext.cross_schedule`). ``infer_batch``
(log-probs, entropy) and ``forward_backward_batch`` (verl's ``ppo_loss``, every gradient)
equal verl's stock step with the feature off on the same weights (fp32, one process; with a
sliding window and under megatron's full recompute too, at TP=2 with sequence parallelism and
at CP=2 on two processes); with the MoE router's statistics, verl's stock step forced onto the
same split. Under pipeline parallelism: ``test_cross_pipeline.py``.

Batches: ``chunks``, 2 agent tasks of 3 episodes (59-65 tokens, common prefixes of 34 and 36)
under a budget of 30: each prefix in 2 chunks, the first task's longest episode a one-member
sub-tree block (its 31-token tail does not fit); ``tree``, 1 agent task of 4 episodes (72-85
tokens, a 34-token prefix, 2 first-turn branches of 13 and 18 shared tokens) under 40: the
prefix in one block (over half the budget: one level refuses it), each branch a block reading
it, 4 suffixes.
"""

import contextlib
import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._batch import PRESET, make_batch, use_cpu_platform  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._engine import actor_config, build_engine, step  # noqa: E402

CROSS = {"mode": "arbitrary_prefix", "min_prefix_len": 1, "cross_micro_batch": True}
BATCHES = {  # name: (agent workload sizes, budget)
    "chunks": (dict(num_tasks=2, num_turns=2, branching=3), 30),
    "tree": (dict(num_tasks=1, num_turns=3, branching=2), 40),
}
STOCK_BUDGET = 200  # verl's own split refuses a sample longer than the budget


def batch(name: str, budget: int | None = None):
    from verl.utils import tensordict_utils as tu

    sizes, nested_budget = BATCHES[name]
    data = make_batch("agent", **sizes)
    tu.assign_non_tensor(data, use_dynamic_bsz=True,
                         max_token_len_per_gpu=budget or nested_budget)
    return data


def _drop_earlier_readers_gradients():
    """The control: the blocks' backward steps take in none of their readers' gradients."""
    from tests.megatron_ext._controls import blocks_take_no_gradients

    return blocks_take_no_gradients()


def steps(rank: int) -> dict:
    """Per batch: verl's stock step (feature off; under a budget its longest sample fits, as
    verl requires: its result does not depend on the split) and the cross-micro-batch one.
    The control: the blocks' backward steps take in none of their readers' gradients. Each on
    a fresh copy of the same seeded model."""
    from unittest import mock

    from prefix_sharing.megatron_ext.cross_steps import GroupSteps
    from tests.megatron_ext._memory import SavedActivations

    use_cpu_platform()
    init = GroupSteps.__init__

    def keeping(self, *args, keep_graph, **kwargs):
        init(self, *args, keep_graph=True, **kwargs)

    # the blocks' graphs kept from their forward step to their backward step instead
    kept = mock.patch.object(GroupSteps, "__init__", keeping)
    results = {}
    for name, mode in [(name, mode) for name in BATCHES for mode in ("off", "cross", "control")
                       ] + [("chunks", "kept")]:
        config = actor_config(None if mode == "off" else CROSS)
        engine = build_engine(config)
        budget = STOCK_BUDGET if mode == "off" else None
        meter = SavedActivations(engine.module[0])
        patch = {"control": _drop_earlier_readers_gradients(), "kept": kept}.get(
            mode, contextlib.nullcontext())
        results[name, mode] = step(engine, config, partial(batch, name, budget),
                                   _together(meter, patch))
        results[name, mode]["saved_peak"] = meter.peak
    return results


@contextlib.contextmanager
def _together(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


@pytest.fixture(scope="module")
def results():
    return run_distributed(steps, 1, timeout=600)[0]


@pytest.mark.parametrize("name", BATCHES)
def test_log_probs_entropy_loss_and_every_gradient_equal_verls_stock_step(results, name):
    same_outputs(results[name, "cross"], results[name, "off"], name, per_micro_batch=False)


@pytest.mark.parametrize("name", BATCHES)
def test_the_controls_fail_on_the_gradients(results, name):
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(results[name, "control"], results[name, "off"], f"{name} control",
                     per_micro_batch=False)


def test_the_blocks_keep_no_activations_across_micro_batches(results):
    """Autograd's saved activations (tests/megatron_ext/_memory.py) at their peak over the
    training step: the blocks, run without grad, keep none between micro-batches (recomputed
    in their backward steps); kept, their graphs add more than the rest of the step holds at
    once."""
    cross, kept = (results["chunks", mode]["saved_peak"] for mode in ("cross", "kept"))
    assert 0 < cross < kept / 2
    same_outputs(results["chunks", "kept"], results["chunks", "off"], "kept",
                 per_micro_batch=False)  # the same step, only held differently


def schedules(name: str) -> list:
    from prefix_sharing import PrefixSharingConfig
    from prefix_sharing.cross_micro_batch import plan_group
    from prefix_sharing.workloads import make_workload

    sizes, budget = BATCHES[name]
    wl = make_workload("agent", vocab_size=PRESET.vocab_size, seed=0, **sizes)
    config = PrefixSharingConfig(min_prefix_len=1)
    return [plan_group([wl.sequences[m] for m in g.members], budget, config) for g in wl.groups]


def assert_nested(result: dict, name: str) -> None:
    """The step's metrics say the batch ``name``'s groups nested: none cut, each block
    computed again in its last reader's backward."""
    metrics = result["train"]["metrics"]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [
        float(sum(b.length for s in schedules(name) for b in s.blocks))]


@pytest.mark.parametrize("name", BATCHES)
def test_every_shared_part_is_computed_once_and_verls_metrics_say_so(results, name):
    groups = schedules(name)
    shapes = {"chunks": [[17, 17, 30], [18, 18]], "tree": [[34, 13, 18]]}[name]
    assert [[b.length for b in s.blocks] for s in groups] == shapes
    metrics = results[name, "cross"]["train"]["metrics"]
    unique = sum(s.tokens_distinct for s in groups)
    assert unique == {"chunks": 119 + 114, "tree": 176}[name]
    # every block once more, in its backward step
    again = sum(b.length for s in groups for b in s.blocks)
    assert metrics["prefix_sharing/tokens_computed"] == [float(unique + again)]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    # a micro-batch's forward computes the blocks opening in it besides its tails (they keep
    # no activations): the first, 17 + 17 + 30 + a 1-token tail; 34 + 13 + a 29-token tail
    assert metrics["prefix_sharing/max_tokens_computed"] == [{"chunks": 65.0, "tree": 76.0}[name]]
    assert metrics["prefix_sharing/num_micro_batches"] == [
        float(sum(len(s.suffixes) for s in groups))]
    # each block once more, in its last reader's backward
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [
        float(sum(b.length for s in groups for b in s.blocks))]
    # the most K/V leaves and gradients held at once: the first task's 17 + 17-row prefix and
    # its 30-row sub-tree block while that block's backward step runs (chunks); the tree's
    # 34-row prefix with one branch's 18 rows
    rows = {"chunks": 17 + 17 + 30, "tree": 34 + 18}[name]
    assert metrics["prefix_sharing/cross_held_bytes"] == [
        float(2 * 2 * PRESET.num_layers * rows * PRESET.num_query_groups * PRESET.head_dim * 4)]


# a 7-key sliding window on every other layer (test_cross_forward.py's)
WINDOW = dict(window_size=(6, 0), window_attn_skip_freq=2)


# megatron's full activation recompute (test_cross_forward.py's)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1)
SETTINGS = {"window": WINDOW, "recompute": RECOMPUTE, "tp2": {"sequence_parallel": True}}


def setting_steps(rank: int, setting: str) -> dict:
    """Per batch, verl's stock step and the nested one on the same setting: the window or
    full recompute at TP=1, or TP=2 with sequence parallelism (two ranks; the
    sequence-parallel parameters' gradients summed over TP as megatron's finalize does).
    Under recompute also the control whose blocks take in none of their readers' gradients
    (their layers replayed inside their backward steps inject them)."""
    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads

    use_cpu_platform()
    tp = 2 if setting == "tp2" else 1
    layout = dict(tensor_model_parallel_size=tp, sequence_parallel=True) if tp > 1 else None
    modes = ("off", "cross", "control") if setting == "recompute" else ("off", "cross")
    results = {}
    for name, mode in [(name, mode) for name in BATCHES for mode in modes]:
        config = actor_config(None if mode == "off" else CROSS, megatron=layout)
        engine = build_engine(config, **SETTINGS[setting])
        budget = STOCK_BUDGET if mode == "off" else None
        results[name, mode] = step(engine, config, partial(batch, name, budget),
                                   _drop_earlier_readers_gradients() if mode == "control"
                                   else None,
                                   finalize=finalize_sequence_parallel_grads if tp > 1 else None)
    return results


@pytest.fixture(scope="module")
def setting_results():
    return {"window": [run_distributed(setting_steps, 1, "window", timeout=600)[0]],
            "recompute": [run_distributed(setting_steps, 1, "recompute", timeout=600)[0]],
            "tp2": run_distributed(setting_steps, 2, "tp2", tp=2, timeout=900)}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", BATCHES)
def test_groups_nest_under_windows_recompute_and_tensor_parallelism(setting_results, setting,
                                                                    name):
    """Every rank equals verl's stock step with the same setting, and the groups nested (none
    cut, each block computed again in its backward step; under megatron's recompute its
    layers replayed there inject the readers' gradients); the recompute control fails."""
    for rank, results in enumerate(setting_results[setting]):
        same_outputs(results[name, "cross"], results[name, "off"], f"{setting} rank {rank}",
                     per_micro_batch=False)
        assert_nested(results[name, "cross"], name)
        if setting == "recompute":
            with pytest.raises(AssertionError, match="grad"):
                same_outputs(results[name, "control"], results[name, "off"],
                             f"{setting} control", per_micro_batch=False)


def moe_steps(rank: int) -> dict:
    """The tiny MoE preset (its aux, seq-aux, global-aux losses and z-loss) on ``chunks`` and
    ``tree``: the nested cross step, then verl's stock step forced onto the split the cross
    step used (the router statistics are each micro-batch's own), then the control whose
    micro-batches keep statistics over the rows they compute (each block counted once, where
    it opens) instead of over their plain micro-batches'."""
    from unittest import mock

    import verl.workers.engine.utils as engine_utils

    from tests.verl_ext.test_cross_forward import (moe_engine, same_split,
                                                   statistics_over_computed_rows)

    use_cpu_platform()
    planned = engine_utils.rearrange_micro_batches
    results = {}
    for name in BATCHES:
        recorded, replayed = same_split(planned)
        for mode in ("cross", "off", "control"):
            split = {"cross": recorded, "off": replayed, "control": planned}[mode]
            config = actor_config(None if mode == "off" else CROSS)
            engine = moe_engine(config)
            wrong = (statistics_over_computed_rows() if mode == "control"
                     else contextlib.nullcontext())
            results[name, mode] = step(
                engine, config, partial(batch, name, STOCK_BUDGET if mode == "off" else None),
                _together(mock.patch.object(engine_utils, "rearrange_micro_batches", split),
                          wrong))
    return results


@pytest.fixture(scope="module")
def moe_results():
    return run_distributed(moe_steps, 1, timeout=900)[0]


@pytest.mark.parametrize("name", BATCHES)
def test_moe_router_statistics_nest_as_verls_stock_step_on_the_same_split(moe_results, name):
    same_outputs(moe_results[name, "cross"], moe_results[name, "off"], f"moe {name}")
    assert_nested(moe_results[name, "cross"], name)
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(moe_results[name, "control"], moe_results[name, "off"], f"moe {name} control")


def context_parallel_steps(rank: int) -> dict:
    """At ``context_parallel_size=2`` (verl's budget is ``max_token_len_per_gpu`` x CP: half
    of each nested budget per GPU, the same schedules as at CP=1): the nested cross step,
    every block and micro-batch split over the CP ranks, and on ``chunks`` the control whose
    last readers drop the gradients the earlier ones accumulated (as :func:`steps`'); the
    gradients averaged over CP as megatron's DDP does."""
    from prefix_sharing.engines.megatron import finalize_context_parallel_grads

    use_cpu_platform()
    results = {}
    for name, mode in [(name, "cross") for name in BATCHES] + [("chunks", "control")]:
        config = actor_config(CROSS, megatron={"context_parallel_size": 2})
        engine = build_engine(config)
        results[name, mode] = step(engine, config, partial(batch, name, BATCHES[name][1] // 2),
                                   _drop_earlier_readers_gradients() if mode == "control"
                                   else None,
                                   finalize=finalize_context_parallel_grads)
    return results


@pytest.fixture(scope="module")
def context_parallel_results():
    return run_distributed(context_parallel_steps, 2, cp=2, timeout=900)


@pytest.mark.parametrize("name", BATCHES)
def test_groups_nest_under_context_parallelism(context_parallel_results, results, name):
    """Both CP ranks return every sample whole and, with the gradients averaged over CP,
    equal verl's stock step at CP=1; the groups nested; the control fails."""
    for rank, result in enumerate(context_parallel_results):
        same_outputs(result[name, "cross"], results[name, "off"], f"cp2 {name} rank {rank}",
                     per_micro_batch=False)
        assert_nested(result[name, "cross"], name)
        if name == "chunks":
            with pytest.raises(AssertionError, match="grad"):
                same_outputs(result[name, "control"], results[name, "off"],
                             f"cp2 control rank {rank}", per_micro_batch=False)
