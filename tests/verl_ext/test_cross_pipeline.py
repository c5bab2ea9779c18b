"""Groups across micro-batches in verl's real Megatron engine under pipeline parallelism
(``pipeline_model_parallel_size=2``, two gloo ranks, TP=1, the dense tiny model in fp32).

verl runs its micro-batches through megatron's 1F1B schedule; each cross group's blocks run
as micro-batches of their own among them (``prefix_sharing/verl_ext/cross_schedule.py``):
before their first reader, without grad, recording the K/V leaves on both stages, and after
their last, again with grad, the readers' gradients injected, so megatron's backward of that
step is the block's backward on every stage. ``infer_batch``
(log-probs, entropy) and ``forward_backward_batch`` (verl's ``ppo_loss``) equal verl's stock
step with the feature off on the same weights at PP=2: every gradient on each stage, and the
last stage's outputs and loss (verl's global token mean, summed over micro-batches: the two
runs split the batch differently). A control whose prefix takes in none of its readers'
gradients fails on the gradients. At PP=2 x CP=2 (four ranks) every micro-batch
is split over the CP ranks, and each rank's stage equals the stock step at PP=2, CP=1. On the
tiny MoE preset, every stage's router statistics equal verl's stock step's on the same split.
Under interleaved stages (PP=2 x VPP=2), one level and nested; and a call whose micro-batch
count does not fit the interleaved schedule's groups, a block's forward step repeated.

Batch: as ``test_cross_forward.py`` (2 agent tasks of 3 episodes, 34- and 36-token common
prefixes). At a budget of 80 both groups cross micro-batches (3 each); at 70 the second
group's prefix is over half the budget and it nests, its blocks' steps micro-batches of
megatron's 1F1B like the first group's.
"""

import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._batch import use_cpu_platform  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._engine import actor_config, build_engine, step  # noqa: E402
from tests.verl_ext.test_cross_forward import (CROSS, RECOMPUTE, SETTINGS, batch,  # noqa: E402
                                               moe_steps)

PIPELINE = {"pipeline_model_parallel_size": 2}


def pipeline_steps(rank: int) -> dict:
    """verl's stock step (feature off), the cross-micro-batch step at budgets 80 and 70, and
    the control, each on a fresh copy of the same seeded model; this rank's stage."""
    from tests.megatron_ext._controls import blocks_take_no_gradients

    use_cpu_platform()
    results = {}
    runs = [(80, "off", None), (80, "cross", CROSS), (70, "cross", CROSS),
            (80, "control", CROSS)]
    for budget, name, prefix_grouper in runs:
        config = actor_config(prefix_grouper, megatron=PIPELINE)
        engine = build_engine(config)
        rows = []  # each forward's rows on this stage (the model's input_ids width)
        engine.module[0].register_forward_pre_hook(
            lambda module, args, kwargs, rows=rows: rows.append(kwargs["input_ids"].size(1)),
            with_kwargs=True)
        results[budget, name] = step(
            engine, config, partial(batch, budget),
            during=blocks_take_no_gradients() if name == "control" else None)
        results[budget, name]["rows"] = rows
    return results


@pytest.fixture(scope="module")
def stages():
    return run_distributed(pipeline_steps, 2, pp=2, timeout=900)


def pipeline_context_parallel_steps(rank: int) -> dict:
    """At PP=2 x CP=2: the cross-micro-batch step at the CP=1 runs' budget of 80 (40 per GPU:
    verl's budget is max_token_len_per_gpu x CP), the gradients averaged over the CP group as
    megatron's DDP does; this rank's stage."""
    from megatron.core import parallel_state

    from prefix_sharing.engines.megatron import finalize_context_parallel_grads

    use_cpu_platform()
    config = actor_config(CROSS, megatron={**PIPELINE, "context_parallel_size": 2})
    engine = build_engine(config)
    rows = []
    engine.module[0].register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].size(1)), with_kwargs=True)
    result = step(engine, config, partial(batch, 40), finalize=finalize_context_parallel_grads)
    return {**result, "rows": rows, "stage": parallel_state.get_pipeline_model_parallel_rank()}


def test_pipeline_x_context_parallel_equals_verls_stock_step_at_cp1(stages):
    ranks = run_distributed(pipeline_context_parallel_steps, 4, pp=2, cp=2, timeout=900)
    assert [rank["stage"] for rank in ranks] == [0, 0, 1, 1]
    for rank, result in enumerate(ranks):
        stock = stages[result["stage"]][80, "off"]
        same_outputs(result, stock, f"pp2 x cp2 rank {rank}", per_micro_batch=False)
        at_cp1 = stages[result["stage"]][80, "cross"]["rows"]
        assert len(result["rows"]) == len(at_cp1)  # the same forwards, each half the rows
        assert sum(at_cp1) <= 2 * sum(result["rows"]) <= sum(at_cp1) + len(at_cp1)
    metrics = ranks[-1]["train"]["metrics"]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]


@pytest.mark.parametrize("budget", (80, 70))
def test_pipeline_parallel_2_equals_verls_stock_step_on_each_stage(stages, budget):
    for rank, results in enumerate(stages):
        cross = results[budget, "cross"]
        same_outputs(cross, results[80, "off"], f"pp2 stage {rank} budget {budget}",
                     per_micro_batch=False)
    metrics = stages[-1][budget, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    if budget == 80:
        assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
        assert metrics["prefix_sharing/max_tokens_computed"][0] <= budget


def test_each_groups_prefix_runs_as_micro_batches_of_its_own_on_every_stage(stages):
    """Both stages run, per group, the 34- or 36-row prefix, its 3 micro-batches, and (in
    training) the prefix again after them: 8 forwards for infer_batch, 10 for
    forward_backward_batch; the prefix computed twice per training step, which the metrics
    report."""
    infer = [34, 31, 26, 28, 36, 26, 23, 29]
    train = [34, 31, 26, 28, 34, 36, 26, 23, 29, 36]
    for results in stages:
        assert results[80, "cross"]["rows"] == infer + train
    metrics = stages[-1][80, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [70.0]
    # each group's unique tokens (119 and 114: test_cross_forward.py) and its prefix again
    assert metrics["prefix_sharing/tokens_computed"] == [float(119 + 114 + 34 + 36)]
    assert metrics["prefix_sharing/num_micro_batches"] == [6.0]


def test_a_control_whose_prefix_takes_in_no_reader_gradients_fails(stages):
    for rank, results in enumerate(stages):
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results[80, "control"], results[80, "off"], f"pp2 stage {rank} control",
                         per_micro_batch=False)


def setting_steps(rank: int) -> dict:
    """Per model setting of ``test_cross_forward.SETTINGS`` (activation recompute, full and
    selective; a sliding window on every other layer): verl's stock step and the
    cross-micro-batch one at a budget of 80, at PP=2 with the same setting; this rank's stage."""
    use_cpu_platform()
    results = {}
    for setting, settings in SETTINGS.items():
        for name, prefix_grouper in (("off", None), ("cross", CROSS)):
            config = actor_config(prefix_grouper, megatron=PIPELINE)
            engine = build_engine(config, **settings)
            results[setting, name] = step(engine, config, partial(batch, 80))
    return results


@pytest.fixture(scope="module")
def setting_stages():
    return run_distributed(setting_steps, 2, pp=2, timeout=900)


@pytest.mark.parametrize("setting", SETTINGS)
def test_recompute_and_windows_under_pipeline_parallelism_equal_verls_stock_step(
        setting_stages, setting):
    """A prefix layer recomputed in the last micro-batch replays inside its backward (after
    its own rows', created later) and injects the leaves' gradients then; a windowed layer's
    suffix rows read only the prefix rows their window sees."""
    for rank, results in enumerate(setting_stages):
        same_outputs(results[setting, "cross"], results[setting, "off"],
                     f"pp2 stage {rank} {setting}", per_micro_batch=False)
    metrics = setting_stages[-1][setting, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]


def layout_steps(rank: int, layout: dict, model: dict, finalize=None,
                 nested: bool = False) -> dict:
    """verl's stock step, the cross-micro-batch step at a budget of 80 (with ``nested`` also
    at 64, both groups nested) and the control (its blocks take in none of their
    readers' gradients), the engine laid out by ``layout`` over a model built with ``model``
    (``build_engine``'s keywords), ``finalize`` applied to every chunk's gradients; this rank's
    stage (and shard, and chunks)."""
    from tests.megatron_ext._controls import blocks_take_no_gradients

    use_cpu_platform()
    results = {}
    runs = [("off", None, 80), ("cross", CROSS, 80), ("control", CROSS, 80)]
    for name, prefix_grouper, budget in runs + ([("nested", CROSS, 64)] if nested else []):
        config = actor_config(prefix_grouper, megatron=layout)
        engine = build_engine(config, **model)
        results[name] = step(engine, config, partial(batch, budget),
                             during=blocks_take_no_gradients() if name == "control" else None,
                             finalize=finalize)
    return results


def _assert_equal_and_control_fails(ranks: list[dict], where: str) -> None:
    """Every rank's gradients and the last stage's outputs equal the stock step's; the
    control fails on the gradients."""
    for rank, results in enumerate(ranks):
        same_outputs(results["cross"], results["off"], f"{where} rank {rank}",
                     per_micro_batch=False)
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results["control"], results["off"], f"{where} rank {rank} control",
                         per_micro_batch=False)


def test_pipeline_x_tensor_parallel_equals_verls_stock_step():
    """At PP=2 x TP=2 with sequence parallelism (four gloo ranks), the gradients of the
    sequence-parallel parameters summed over TP as megatron's finalize does: every rank's
    gradients (its stage, its shard) and the last stage's outputs; each rank's received
    activation splits at its slice of the prefix rows. The control fails."""
    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads

    layout = {**PIPELINE, "tensor_model_parallel_size": 2, "sequence_parallel": True}
    ranks = run_distributed(layout_steps, 4, layout, {"sequence_parallel": True},
                            finalize_sequence_parallel_grads, tp=2, pp=2, timeout=900)
    _assert_equal_and_control_fails(ranks, "pp2 x tp2")
    metrics = ranks[-1]["cross"]["train"]["metrics"]  # rank 3: the last stage
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    assert metrics["prefix_sharing/groups_split"] == [0.0]


MOE_SETTINGS = {"plain": {}, "recompute": RECOMPUTE["full"]}


@pytest.mark.parametrize("setting", MOE_SETTINGS)
def test_moe_router_statistics_under_pipeline_parallelism_equal_verls_stock_step(setting):
    """The tiny MoE preset with its router losses at PP=2 (``test_cross_forward.moe_steps``:
    verl's stock step forced onto the cross step's split, since router statistics are each
    micro-batch's own): each stage's routers read the prefix rows' router logits recorded in
    the carrying micro-batches, so every suffix's statistics are its plain micro-batch's; equal
    on every stage, gradients included, and the control (statistics over the computed rows
    only) fails."""
    stages = run_distributed(moe_steps, 2, MOE_SETTINGS[setting], PIPELINE, pp=2, timeout=900)
    for rank, results in enumerate(stages):
        same_outputs(results["cross"], results["off"], f"moe pp2 {setting} stage {rank}")
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results["control"], results["off"],
                         f"moe pp2 {setting} stage {rank} control")
    metrics = stages[-1]["cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [70.0]


def test_interleaved_stages_equal_verls_stock_step_on_every_chunk():
    """At PP=2 x VPP=2 (a layer per model chunk, verl's interleaved schedule) each group's
    block steps are micro-batches of the interleaved schedule, every model chunk recording the
    K/V of its own layers in a store of its own (the schedule keeps each chunk's forwards and
    backwards in micro-batch order): every chunk's gradients and the last stage's outputs equal
    verl's stock step there, one level (a budget of 80) and nested (64: both groups, 2
    micro-batches each, their tails packed under the whole budget; at 70 the two groups take 5
    micro-batches, which verl's interleaved split cannot fill to a multiple of PP: an error
    says so); each sample's tokens are counted once, not once per chunk; the control fails on
    the gradients."""
    import dataclasses

    from tests.verl_ext._engine import PRESET

    layout = {**PIPELINE, "virtual_pipeline_model_parallel_size": 2}
    ranks = run_distributed(layout_steps, 2, layout,
                            {"preset": dataclasses.replace(PRESET, num_layers=4)}, None, True,
                            pp=2, vpp=2, timeout=900)
    _assert_equal_and_control_fails(ranks, "pp2 x vpp2")
    for rank, results in enumerate(ranks):
        same_outputs(results["nested"], results["off"], f"pp2 x vpp2 nested rank {rank}",
                     per_micro_batch=False)
    metrics = ranks[-1]["cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    # each group's unique tokens (119 and 114: test_cross_forward.py) and its prefix again
    assert metrics["prefix_sharing/tokens_computed"] == [float(119 + 114 + 34 + 36)]


ONE_TASK = dict(num_tasks=1, num_turns=3, branching=2)  # one group, 72-85 tokens per sample


def repeat_steps(rank: int, layout: dict, model: dict) -> dict:
    """verl's stock step (at a budget of 96: its samples are up to 85 tokens) and the
    cross-micro-batch one on one agent task at a budget of 64: the group nests, its prefix and
    sub-tree in 3 blocks read by 2 micro-batches, so ``infer_batch``'s call (2 micro-batches
    and 3 forward steps) does not fit the interleaved schedule's groups of 2 and repeats its
    first block's forward step once."""
    from verl.utils import tensordict_utils as tu

    from tests.verl_ext._batch import make_batch

    def one_task(budget: int):
        data = make_batch("agent", **ONE_TASK)
        tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
        return data

    from unittest import mock

    from prefix_sharing.megatron_ext import cross_steps

    calls = []  # (micro-batches asked for, micro-batches run) per call of megatron's schedule
    stock = cross_steps.fit_interleaved

    def fit(items, *args):
        fitted = stock(items, *args)
        calls.append((len(items), len(fitted)))
        return fitted

    use_cpu_platform()
    results = {}
    for name, prefix_grouper, budget in (("off", None, 96), ("cross", CROSS, 64)):
        config = actor_config(prefix_grouper, megatron=layout)
        with mock.patch.object(cross_steps, "fit_interleaved", fit):
            results[name] = step(build_engine(config, **model), config,
                                 partial(one_task, budget))
    results["calls"] = calls
    return results


def test_a_call_that_does_not_fit_the_interleaved_groups_repeats_a_block_forward_exactly():
    """The repeated forward step records the same K/V again before any reader: each sample's
    log-probs and entropy equal verl's stock step (which runs its own count), and so do the
    training step's gradients and loss (whose call fits)."""
    import dataclasses

    from tests.verl_ext._engine import PRESET

    layout = {**PIPELINE, "virtual_pipeline_model_parallel_size": 2}
    ranks = run_distributed(repeat_steps, 2, layout,
                            {"preset": dataclasses.replace(PRESET, num_layers=4)},
                            pp=2, vpp=2, timeout=900)
    for rank, results in enumerate(ranks):
        same_outputs(results["cross"], results["off"], f"repeat rank {rank}",
                     per_micro_batch=False)
        # infer_batch: 2 micro-batches + 3 block forwards, one repeated; the training step's
        # 2 + 3 forward and 3 backward steps fit
        assert results["calls"] == [(5, 6), (8, 8)]
    train = ranks[-1]["cross"]["train"]["metrics"]
    assert train["prefix_sharing/num_micro_batches"] == [2.0]
