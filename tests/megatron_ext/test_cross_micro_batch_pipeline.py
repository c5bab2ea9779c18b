"""A group across micro-batches under pipeline parallelism (PP=2, 1F1B): exact.

One GRPO group (a 41-token prompt, 6 responses) under an 84-token budget at PP=2 on two gloo
ranks, each step of its schedule a micro-batch of megatron's 1F1B: the prompt's block without
grad, the suffixes reading its K/V leaves, and the block's backward step after its last
reader, its forward again with grad, its own rows reading their recorded K/V with the readers'
gradients injected (``record_last``) - megatron's own backward of that step, on each stage, is
the prompt's. Judged on both stages as ``verify`` judges (the float64 verdict against
megatron's stock step on the same samples in the same micro-batches; within 1e-5 of its fp32
run): the last stage's logits, log-probs, entropy and loss, and every gradient of each stage.
A control whose backward steps inject nothing fails on the gradients. The same group within
one suffix micro-batch; TP=2 x PP=2 on four ranks, without and with sequence parallelism: the
same verdict on every rank. The tiny MoE preset with router statistics (two groups; the
expert bias on one): outputs, gradients and every router statistic equal the stock step's; a
control weighing each group's router losses by its own micro-batch count (megatron's schedule
left alone) fails on the gradients. CP=2 x PP=2 on four ranks (each micro-batch split over
the CP ranks) against the stock step at PP=2 on the same split. Megatron's activation
recompute, full and selective (the prompt's layers replayed inside its backward step inject
the readers' gradients there); a control that injects nothing fails on the gradients. The
prompt in two chunks (budget 36): exact at PP=2 alone and under full recompute, with TP=2 and
sequence parallelism, at CP=2, with MoE router statistics, and under interleaved stages.
The tiny-window preset (16-key windows on layers 1 and 3, one per stage, learned sinks), one
level and in two chunks: exact on both stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.engines.recompute import RECOMPUTE
from prefix_sharing.presets import get_preset
from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff, within_tolerance
from prefix_sharing.workloads import make_workload

from ._distributed import PRESET, run_distributed, tiny_gpt
from ._router_statistics import reset_router_statistics, router_statistics
from .test_cross_micro_batch import (_LOSSES, MOE, MOE_VARIANTS, _split_runs,
                                     assert_exact, assert_router_statistics_equal)

CONFIG = PrefixSharingConfig(min_prefix_len=1, backend="torch")
BUDGET = 84
ONE_SUFFIX = 170  # the group's 162 unique tokens fit
NESTED = 36  # under the 41-token prompt: the prompt in two chunks
WINDOWED = get_preset("tiny-window")


def _group(seed: int = 5) -> list[torch.Tensor]:
    return make_workload("grpo", num_prompts=1, group_size=6, prompt_len=(40, 41),
                         response_len=(12, 24), vocab_size=PRESET.vocab_size, seed=seed).sequences


def _judged(cross, seqs, build=tiny_gpt) -> dict:
    from prefix_sharing.engines.megatron import compare

    (plain, _), (reference, _) = _split_runs(build, seqs, cross)
    schedule = cross.schedules[0]
    return {"vs_reference": compare(cross.run, reference), "plain": compare(plain, reference),
            "vs_plain": compare(cross.run, plain), "figures": cross.report(),
            "outputs": len(cross.run.outputs), "runs": (plain, reference),
            "suffix_rows": [s.plan.num_tokens_unique for s in schedule.suffixes],
            "padded_rows": [p.input_ids.numel()
                            for p in (schedule.blocks[0].plan, *(s.plan for s in schedule.suffixes))]}


def _assert_gradients_fail(run: dict) -> None:
    verdict = within_tolerance(run["vs_reference"], run["plain"], torch.float32)
    assert not verdict["grads"], run["vs_reference"].max_rel_diff


@contextlib.contextmanager
def _never_injected():
    """Wrong: a block's backward step records its K/V again without the leaves' accumulated
    gradients, so its backward misses every reader's dK/dV."""
    from prefix_sharing import prefix_kv

    with mock.patch.object(prefix_kv, "_injected", lambda recorded, leaf, key, store: recorded):
        yield


CONTROLS = {"never_injected": _never_injected}


def _job(rank: int, runs: dict) -> dict:
    """``runs``: name -> (budget, TransformerConfig overrides of every model of the run (and
    ``preset``: another preset than the tiny one), the name of a control or None)."""
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import gpt_model

    seqs = _group()
    report = {}
    for name, (budget, overrides, control) in runs.items():
        def build(layout: str, overrides=overrides, **more) -> torch.nn.Module:
            settings = dict(overrides)
            return gpt_model(settings.pop("preset", PRESET), layout=layout, **settings, **more)

        with CONTROLS[control]() if control else contextlib.nullcontext():
            cross = forward_backward_cross(build("shared"), seqs, budget, CONFIG)
        report[name] = _judged(cross, seqs, build)
    return report


RUNS = {
    "cross": (BUDGET, {}, None),
    # wrong: the prompt's backward step takes in none of its readers' gradients
    "never_injected": (BUDGET, {}, "never_injected"),
    # the whole group within the budget: one suffix between the prompt's two steps
    "one_suffix": (ONE_SUFFIX, {}, None),
    # megatron's activation recompute on every model of the run: the prompt's layers replay
    # inside its backward step, injecting the readers' gradients there
    **{name: (BUDGET, settings, None) for name, settings in RECOMPUTE.items()},
    # wrong: the recomputed prompt layers inject none of their readers' gradients
    "recompute_never_injected": (BUDGET, RECOMPUTE["full"], "never_injected"),
    # at 60 one level, at 36 the prompt in two chunks
    **{name: (budget, overrides, None) for name, budget, overrides in (
        ("block_steps", 60, {}), ("nested", NESTED, {}),
        ("nested_recompute", NESTED, RECOMPUTE["full"]))},
    # wrong: the blocks' backward steps take in none of their readers' gradients
    "nested_never_injected": (NESTED, {}, "never_injected"),
    # 16-key windows on layers 1 and 3 (one per stage), learned sinks: one level and nested
    **{name: (budget, {"preset": WINDOWED}, None) for name, budget in (
        ("window", BUDGET), ("nested_window", NESTED))},
}


@pytest.fixture(scope="module")
def stages() -> list[dict]:
    return run_distributed(_job, 2, RUNS, pp=2, timeout=600)


@pytest.mark.parametrize("name", ["cross", "one_suffix", *RECOMPUTE, "window",
                                  "nested_window"])
def test_equals_the_stock_step_on_every_stage(stages, name):
    first, last = stages
    assert first[name]["outputs"] == 0 and last[name]["outputs"] >= 1
    for stage in stages:
        assert_exact(stage[name])


@pytest.mark.parametrize("name", ["block_steps", "nested", "nested_recompute"])
def test_blocks_in_chunks_run_their_steps_as_micro_batches(stages, name):
    """Each step a micro-batch of megatron's 1F1B: a block without grad, the suffixes reading
    the leaves, then the block again with grad after its last reader, the readers' gradients
    injected into its own K/V (``record_last``). Exact on both stages, also under full
    recompute (a recomputed block layer injects in its replay); every block computed
    twice."""
    for stage in stages:
        run = stage[name]
        assert_exact(run)
        figures = run["figures"]
        blocks = 2 if name.startswith("nested") else 1
        assert figures["num_shared_blocks"] == blocks
        assert figures["recomputed_tokens"] == sum(figures["prefix_lens"]) == 41
        assert figures["max_tokens_computed"] <= NESTED if blocks == 2 else 60


def test_a_control_whose_block_steps_inject_nothing_fails(stages):
    for stage in stages:
        _assert_gradients_fail(stage["nested_never_injected"])


def test_a_group_in_one_suffix_runs_between_its_prompts_steps(stages):
    for stage in stages:
        figures = stage["one_suffix"]["figures"]
        assert len(stage["one_suffix"]["suffix_rows"]) == 1
        assert figures["recomputed_tokens"] == sum(figures["prefix_lens"])


def test_the_prompt_is_computed_twice_and_the_budget_kept(stages):
    for stage in stages:
        run = stage["cross"]
        figures = run["figures"]
        (prefix_len,) = figures["prefix_lens"]
        assert figures["num_micro_batches"] == 1 + len(run["suffix_rows"])
        assert len(run["suffix_rows"]) >= 2
        assert figures["max_tokens_computed"] == max(prefix_len, *run["suffix_rows"]) <= BUDGET
        assert figures["recomputed_tokens"] == prefix_len
        assert figures["tokens_computed"] == figures["tokens_unique"] + prefix_len
        # this stage's layer: K and V, leaves and gradients, fp32
        head_dim = PRESET.hidden_size // PRESET.num_attention_heads
        assert figures["held_bytes"] == (2 * 2 * (PRESET.num_layers // 2) * prefix_len
                                         * PRESET.num_query_groups * head_dim * 4)


@pytest.mark.parametrize("control", ["never_injected", "recompute_never_injected"])
def test_controls_fail_on_the_gradients(stages, control):
    for stage in stages:
        _assert_gradients_fail(stage[control])
    last = within_tolerance(stages[1][control]["vs_reference"], stages[1][control]["plain"],
                            torch.float32)
    assert last["log_probs"] and last["loss"]  # the forward is untouched


def _cp_job(rank: int) -> dict:
    """At CP=2 x PP=2: the group and the control that injects nothing, this rank's run and
    its stage."""
    from megatron.core import parallel_state

    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross

    report = {"stage": parallel_state.get_pipeline_model_parallel_rank()}
    for name, budget in (("cross", BUDGET), ("never_injected", BUDGET),
                         ("nested", NESTED)):
        model, rows = tiny_gpt("shared"), []  # each forward's rows on this rank
        model.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["input_ids"].size(1)),
            with_kwargs=True)
        with CONTROLS[name]() if name in CONTROLS else contextlib.nullcontext():
            cross = forward_backward_cross(model, _group(), budget, CONFIG)
        report[name] = {"run": cross.run, "figures": cross.report(), "rows": rows}
    return report


def test_context_parallel_2_by_pipeline_parallel_2(stages):
    """Four ranks, each stage's micro-batches split over two CP ranks (the prompt's block's
    rows too): the same schedule as at CP=1, and every rank's stage equals megatron's stock
    step at PP=2, CP=1 (its attention cannot split a sequence) on the same split; the control
    fails on the gradients."""
    from prefix_sharing.engines.megatron import compare

    ranks = run_distributed(_cp_job, 4, pp=2, cp=2, timeout=900)
    assert [rank["stage"] for rank in ranks] == [0, 0, 1, 1]
    for rank in ranks:
        plain, reference = stages[rank["stage"]]["cross"]["runs"]
        judged = {name: {"vs_reference": compare(rank[name]["run"], reference),
                         "plain": compare(plain, reference),
                         "vs_plain": compare(rank[name]["run"], plain)}
                  for name in ("cross", "never_injected")}
        assert_exact(judged["cross"])
        _assert_gradients_fail(judged["never_injected"])
        figures = rank["cross"]["figures"]
        assert figures == stages[rank["stage"]]["cross"]["figures"]
        # each forward (the prompt's twice, each suffix's) ran this rank's half of its rows,
        # each padded to a multiple of 2
        rows, at_cp1 = rank["cross"]["rows"], stages[rank["stage"]]["cross"]["padded_rows"]
        whole = sum(at_cp1) + at_cp1[0]
        assert len(rows) == figures["num_micro_batches"] + 1
        assert whole <= 2 * sum(rows) <= whole + len(rows)
        # the prompt in two chunks, each step a micro-batch split over the CP ranks
        plain, reference = stages[rank["stage"]]["nested"]["runs"]
        assert_exact({"vs_reference": compare(rank["nested"]["run"], reference),
                      "plain": compare(plain, reference),
                      "vs_plain": compare(rank["nested"]["run"], plain)})
        assert rank["nested"]["figures"] == stages[rank["stage"]]["nested"]["figures"]


TP_RUNS = {sequence_parallel: (BUDGET, dict(sequence_parallel=sequence_parallel), None)
           for sequence_parallel in (False, True)}
# the prompt in two chunks, each step a micro-batch, every part padded to 2 and split
TP_RUNS["nested"] = (NESTED, dict(sequence_parallel=True), None)


@pytest.fixture(scope="module")
def tp_stages() -> list[dict]:
    """TP=2 x PP=2, without and with sequence parallelism (each micro-batch's rows padded to 2
    and split over the tensor-parallel ranks)."""
    return run_distributed(_job, 4, TP_RUNS, tp=2, pp=2, timeout=900)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_2_by_pipeline_parallel_2(tp_stages, sequence_parallel):
    for rank in tp_stages:
        run = rank[sequence_parallel]
        assert_exact(run)
        assert len(run["suffix_rows"]) >= 2
        if sequence_parallel:  # the prompt's 41 rows and every suffix's padded to 2
            assert run["padded_rows"][0] == 42 and all(n % 2 == 0 for n in run["padded_rows"])
    assert [rank[sequence_parallel]["outputs"] > 0 for rank in tp_stages] == [False, False,
                                                                            True, True]


def test_a_nested_schedule_under_tensor_parallel_2_by_pipeline_parallel_2(tp_stages):
    """The prompt in two chunks under sequence parallelism: each step a micro-batch of 1F1B,
    its rows split over the tensor-parallel ranks; every rank equals the stock step."""
    for rank in tp_stages:
        run = rank["nested"]
        assert_exact(run)
        assert run["figures"]["num_shared_blocks"] == 2
        assert all(n % 2 == 0 for n in run["padded_rows"])


def _moe_job(rank: int) -> dict:
    """The tiny MoE preset (8 experts, top-2) at PP=2: two GRPO groups with the router's aux +
    seq-aux + global-aux losses and z-loss (each group its own schedule, its router
    losses weighted by the step's micro-batch count), one with sigmoid scores and the expert
    bias; every output, gradient and router statistic of each stage against the stock step on
    the same split. The control weighs each group's router losses as megatron's schedule does
    by itself (by the group's own micro-batch count)."""
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import gpt_model
    from prefix_sharing.megatron_ext import cross_micro_batch

    two = make_workload("grpo", num_prompts=2, group_size=6, prompt_len=(40, 41),
                        response_len=(12, 24), vocab_size=MOE.vocab_size, seed=5)
    members = [g.members for g in two.groups]
    runs = {"losses": (two.sequences, members, "losses", BUDGET),
            "expert_bias": (_group(), None, "expert_bias", BUDGET),
            # one group: its 4 micro-batches (the prompt's two steps among them) against the
            # step's 2, so weighing by the group's own count is wrong
            "group_weight": (_group(), None, "losses", BUDGET),
            # each prompt in two chunks: the chunks route without statistics, every suffix's
            # statistics read them
            "nested": (two.sequences, members, "losses", NESTED)}
    report = {}
    for name, (seqs, groups, variant, budget) in runs.items():
        def build(layout: str, settings=MOE_VARIANTS[variant], **overrides) -> torch.nn.Module:
            return gpt_model(MOE, layout=layout, **settings, **overrides)

        ours = build("shared")
        reset_router_statistics(ours)
        control = (mock.patch.object(cross_micro_batch, "within_the_step",
                                     lambda model, factor, accumulate: contextlib.nullcontext(1.0))
                   if name == "group_weight" else contextlib.nullcontext())
        with control:
            cross = forward_backward_cross(ours, seqs, budget, CONFIG, groups=groups)
        stats = router_statistics(ours)
        (_, plain_stats), _ = _split_runs(build, seqs, cross)
        report[name] = {**_judged(cross, seqs, build), "statistic_names": sorted(plain_stats),
                        "groups": len(cross.schedules), "plain_statistics": plain_stats,
                        "statistics": {k: max_rel_diff(v, plain_stats[k])
                                       for k, v in stats.items()}}
    return report


@pytest.fixture(scope="module")
def moe_stages() -> list[dict]:
    return run_distributed(_moe_job, 2, pp=2, timeout=900)


@pytest.mark.parametrize("variant", ["losses", "expert_bias", "nested"])
def test_moe_with_router_statistics(moe_stages, variant):
    for stage in moe_stages:
        run = stage[variant]
        assert_exact(run)
        assert_router_statistics_equal(run)
        assert {k for k in _LOSSES if k.startswith("tracker.")} <= set(run["statistic_names"])
    assert moe_stages[0][variant]["groups"] == (1 if variant == "expert_bias" else 2)
    if variant == "nested":  # each group's prompt in two chunks
        assert moe_stages[0][variant]["figures"]["num_shared_blocks"] == 4


def test_moe_control_weighing_router_losses_per_group_fails(moe_stages):
    for stage in moe_stages:
        _assert_gradients_fail(stage["group_weight"])


def _moe_cp_job(rank: int) -> dict:
    """At PP=2 x CP=2: ``_moe_job``'s two GRPO groups with the router losses, this rank's run,
    router statistics and stage."""
    from megatron.core import parallel_state

    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import gpt_model

    two = make_workload("grpo", num_prompts=2, group_size=6, prompt_len=(40, 41),
                        response_len=(12, 24), vocab_size=MOE.vocab_size, seed=5)
    ours = gpt_model(MOE, layout="shared", **MOE_VARIANTS["losses"])
    reset_router_statistics(ours)
    cross = forward_backward_cross(ours, two.sequences, BUDGET, CONFIG,
                                   groups=[g.members for g in two.groups])
    return {"run": cross.run, "statistics": router_statistics(ours),
            "stage": parallel_state.get_pipeline_model_parallel_rank()}


def test_moe_under_context_parallel_2_by_pipeline_parallel_2(moe_stages):
    """Four ranks: each stage's router statistics split over its two CP ranks as megatron's
    stock router splits a plain micro-batch (megatron's schedule scales the router losses by
    the CP size); every rank's outputs and gradients equal the stock step at PP=2, CP=1 on the
    same split, and the statistics of each stage's CP ranks, per-rank shares summed, equal
    its statistics there."""
    from prefix_sharing.engines.megatron import compare

    ranks = run_distributed(_moe_cp_job, 4, pp=2, cp=2, timeout=900)
    assert [rank["stage"] for rank in ranks] == [0, 0, 1, 1]
    for rank in ranks:
        plain, reference = moe_stages[rank["stage"]]["losses"]["runs"]
        assert_exact({"vs_reference": compare(rank["run"], reference),
                      "plain": compare(plain, reference), "vs_plain": compare(rank["run"], plain)})
    for stage in (0, 1):
        held = [rank for rank in ranks if rank["stage"] == stage]
        plain_stats = moe_stages[stage]["losses"]["plain_statistics"]
        assert "tracker.z_loss" in plain_stats
        for key, value in plain_stats.items():
            share = key.startswith("tracker.") or key.endswith(".tokens_per_expert")
            ours = (sum(r["statistics"][key] for r in held) if share
                    else held[0]["statistics"][key])
            assert max_rel_diff(ours, value) <= FP32_RTOL, (stage, key)


FOUR_LAYERS = dataclasses.replace(PRESET, num_layers=4)
P2P = dict(overlap_p2p_comm=True, batch_p2p_comm=False)  # megatron's setting under VPP


# name -> (budget, the name of a control or None)
INTERLEAVED_RUNS = {
    "cross": (BUDGET, None), "never_injected_one_level": (BUDGET, "never_injected"),
    # the prompt in two chunks: each step a micro-batch of its own
    "nested": (NESTED, None), "never_injected": (NESTED, "never_injected")}


def _interleaved_job(rank: int) -> dict:
    """At PP=2 x VPP=2 (a layer per model chunk): each of :data:`INTERLEAVED_RUNS` against
    megatron's stock step through its interleaved schedule on the same split (fp32 and
    float64)."""
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import compare, forward_backward, model_chunks

    seqs = _group()
    report = {}
    for name, (budget, control) in INTERLEAVED_RUNS.items():
        with CONTROLS[control]() if control else contextlib.nullcontext():
            cross = forward_backward_cross(model_chunks(FOUR_LAYERS, **P2P), seqs, budget,
                                           CONFIG)
        batches = [[seqs[i] for i in members] for members in cross.plain_split]
        plain, reference = (forward_backward(model_chunks(FOUR_LAYERS, dtype=dtype, **P2P),
                                             batches, "padded")
                            for dtype in (torch.float32, torch.float64))
        report[name] = {"vs_reference": compare(cross.run, reference),
                        "plain": compare(plain, reference), "vs_plain": compare(cross.run, plain),
                        "figures": cross.report(), "outputs": len(cross.run.outputs)}
    return report


@pytest.fixture(scope="module")
def interleaved_stages() -> list[dict]:
    return run_distributed(_interleaved_job, 2, pp=2, vpp=2, timeout=900)


def test_interleaved_stages_equal_the_stock_step_on_every_chunk(interleaved_stages):
    """Every chunk of both ranks runs the prompt's steps on its own layers (megatron's
    interleaved schedule keeps each chunk's forwards and backwards in micro-batch order): the
    last stage's outputs and every chunk's gradients pass the float64 verdict and are within
    1e-5 of the plain fp32 run; the control fails on the gradients."""
    first, last = interleaved_stages
    assert first["cross"]["outputs"] == 0 and last["cross"]["outputs"] >= 1
    for stage in (first, last):
        assert_exact(stage["cross"])
        _assert_gradients_fail(stage["never_injected_one_level"])
        figures = stage["cross"]["figures"]
        (prefix_len,) = figures["prefix_lens"]
        assert figures["recomputed_tokens"] == prefix_len



@pytest.mark.parametrize("count, pp, group, repeats", [
    (4, 2, 2, 0), (3, 2, 2, 1), (2, 2, 4, 2), (9, 4, 4, 3), (6, 2, 4, 0), (5, 2, 4, 1)])
def test_a_call_that_does_not_fit_megatrons_groups_repeats_its_first_block_forward(
        count, pp, group, repeats):
    """Megatron's interleaved schedule takes a call's micro-batches in groups of
    ``microbatch_group_size_per_vp_stage``, at least one, and a last partial group of at least
    PP: a call that does not fit (a forward-only verl step with an odd number of blocks, say)
    repeats its first block's forward step right after it - which records the same K/V and
    outputs again before any reader - until it does. (No stock step runs at such a count to
    compare a run with; the repeat is a forward step without grad as every block's under PP.)"""
    from types import SimpleNamespace

    from prefix_sharing.megatron_ext import cross_steps

    chunk = SimpleNamespace(config=SimpleNamespace(microbatch_group_size_per_vp_stage=group))
    items = [("suffix", 0), ("forward", 0)] + [("suffix", j) for j in range(1, count - 1)]
    with mock.patch("megatron.core.parallel_state.get_pipeline_model_parallel_world_size",
                    return_value=pp):
        fitted = cross_steps.fit_interleaved(items, [chunk, chunk],
                                             lambda item: item[0] == "forward")
        assert cross_steps.fit_interleaved(items, [chunk], lambda item: True) is items
    assert fitted == items[:2] + [("forward", 0)] * repeats + items[2:]


def test_a_nested_schedule_under_interleaved_stages(interleaved_stages):
    """The prompt in two chunks at PP=2 x VPP=2: every step a micro-batch of megatron's
    interleaved schedule, each chunk's blocks computed again in their backward steps with
    their readers' gradients injected: exact on every chunk of both ranks; the control whose
    backward steps inject nothing fails on the gradients."""
    first, last = interleaved_stages
    assert first["nested"]["outputs"] == 0 and last["nested"]["outputs"] >= 1
    for stage in (first, last):
        assert_exact(stage["nested"])
        figures = stage["nested"]["figures"]
        assert figures["num_shared_blocks"] == 2
        assert figures["recomputed_tokens"] == sum(figures["prefix_lens"]) == 41
        _assert_gradients_fail(stage["never_injected"])
