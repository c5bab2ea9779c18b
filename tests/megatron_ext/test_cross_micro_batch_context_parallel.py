"""A group across micro-batches under context parallelism (CP=2): its prefix once, exact.

The agent group of :mod:`.test_cross_micro_batch` (a 113-token prefix, 9 episodes) runs on two
CP ranks, every micro-batch (block or suffix) split over them: under a 150-token budget (the
prefix in one block, 3 suffix micro-batches; its graph kept, and recomputed) and under a
60-token budget (the prefix in chunks, each read by the next, then sub-trees with blocks of
their own). The reference is megatron's stock step on the same split at CP=1 (its attention
cannot split a sequence), judged as ``verify`` judges: the float64 verdict and within 1e-5 of
the plain fp32 run, on both ranks - logits, log-probs, entropy, loss, every gradient.

With sliding windows and learned sinks (the tiny-window preset) too, under the 150-token
budget; with megatron's activation recompute (selective, one level; full, on the nested
schedule), a recomputed layer replaying its first run's mode on its CP slice; and at CP=2 x
TP=2 (4 ranks), with and without sequence parallelism. On the tiny MoE preset (a GRPO group
under a 70-token budget, the router's losses and the expert bias) the router statistics too,
each rank's share summed over CP against the stock step's at CP=1. The controls: the blocks'
backward returns to the rows' owner only the dK/dV of the readers on the same rank (the
reduce-scatter's exchange of the other rank's readers' gradients dropped); a replayed prefix
layer records as a first run (so it takes in no reader's dK/dV); megatron's own z-loss (each
rank's mean over the plain rows it routes).
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch

from prefix_sharing.equivalence import FP32_RTOL, QUANTITIES, max_rel_diff, within_tolerance

from ._distributed import PRESET, run_distributed
from .test_cross_micro_batch import BUDGET, CONFIG, _group, _split_runs
from .test_cross_micro_batch_settings import (CHUNKED, RECOMPUTE, WINDOWED,
                                              _replay_records_again)

CASES = {  # name: budget, recompute_prefix, preset, megatron's recompute settings
    "one_level": (BUDGET, False, PRESET, {}), "recomputed": (BUDGET, True, PRESET, {}),
    "chunked": (CHUNKED, False, PRESET, {}),
    # 16-key windows on layers 1 and 3 of 4, learned sinks, against the 113-token prefix
    "window": (BUDGET, False, WINDOWED, {}),
    "selective": (BUDGET, False, PRESET, RECOMPUTE["selective"]),
    "full_chunked": (CHUNKED, False, PRESET, RECOMPUTE["full_block"]),
}
CONTROLS = {  # name: the case it runs, wrong
    "control": "one_level", "replay_control": "selective",
}


@contextlib.contextmanager
def _readers_on_other_ranks_dropped():
    """Wrong: each rank sends back, for the block rows another rank owns, no dK/dV (its own
    readers' gradients of those rows are dropped before the reduce-scatter)."""
    from megatron.core import parallel_state

    from prefix_sharing.prefix_kv import PrefixKV

    term = PrefixKV.gradient_term

    def own_rows_only(self):
        rank = parallel_state.get_context_parallel_rank()
        per_rank = -(-self.rows // 2)  # the block's rows, padded to a multiple of CP = 2
        for leaves in self.leaves.values():
            for leaf in leaves:
                if leaf.grad is not None:
                    keep = torch.zeros_like(leaf.grad)
                    keep[rank * per_rank:(rank + 1) * per_rank] = 1
                    leaf.grad.mul_(keep)
        return term(self)

    with mock.patch.object(PrefixKV, "gradient_term", own_rows_only):
        yield


def _build(preset, settings):
    from prefix_sharing.engines.megatron import gpt_model

    return lambda layout, **overrides: gpt_model(preset, layout=layout, **settings, **overrides)


def _run(name: str):
    """One case's cross run on this rank (a control: its case, wrong)."""
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross

    budget, recompute, preset, settings = CASES[CONTROLS.get(name, name)]
    wrong = {"control": _readers_on_other_ranks_dropped,
             "replay_control": _replay_records_again}.get(name, contextlib.nullcontext)
    with wrong():
        return forward_backward_cross(_build(preset, settings)("shared"), _group(), budget,
                                      CONFIG, recompute_prefix=recompute)


def _reference_job(rank: int) -> dict:
    """At CP=1: each case's split (its cross run's) through megatron's stock step, fp32 and
    float64."""
    report = {}
    for name, (_, _, preset, settings) in CASES.items():
        cross = _run(name)
        (plain, _), (reference, _) = _split_runs(_build(preset, settings), _group(), cross)
        report[name] = {"plain": plain, "reference": reference, "figures": cross.report()}
    return report


def _cp_job(rank: int) -> dict:
    from prefix_sharing.megatron_ext import core_attention

    rows = []  # (this rank's rows, all ranks' rows) of each K/V all-gather
    gather_rows = core_attention.gather_rows

    def counted(x, cp):
        out = gather_rows(x, cp)
        rows.append((x.size(0), out.size(0)))
        return out

    report = {}
    with mock.patch.object(core_attention, "gather_rows", counted):
        for name in [*CASES, *CONTROLS]:
            start = len(rows)
            cross = _run(name)
            report[name] = {"run": cross.run, "figures": cross.report(),
                            "gathered_rows": rows[start:]}
    return report


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_reference_job, 1, timeout=600)[0]


@pytest.fixture(scope="module")
def cp2() -> list[dict]:
    return run_distributed(_cp_job, 2, cp=2, timeout=900)


def _compared(run, case: dict) -> dict:
    from prefix_sharing.engines.megatron import compare

    return {"vs_reference": compare(run, case["reference"]),
            "plain": compare(case["plain"], case["reference"]),
            "vs_plain": compare(run, case["plain"])}


@pytest.mark.parametrize("name", CASES)
def test_cp2_equals_the_stock_step_on_the_same_split(cp2, reference, name):
    for rank, result in enumerate(cp2):
        run = _compared(result[name]["run"], reference[name])
        verdict = within_tolerance(run["vs_reference"], run["plain"], torch.float32)
        assert set(verdict) == set(QUANTITIES) and all(verdict.values()), (
            rank, run["vs_reference"].max_rel_diff, run["plain"].max_rel_diff)
        for q, d in run["vs_plain"].max_rel_diff.items():
            assert d <= FP32_RTOL, f"CP rank {rank}: {q}: {d} from the plain fp32 run"


@pytest.mark.parametrize("name", CASES)
def test_the_same_schedule_as_at_cp1_each_prefix_once(cp2, reference, name):
    """The split, the blocks and the computed tokens are CP=1's; each rank holds the whole
    prefix's K/V leaves and gradients, as CP=1 does (2 x 2 x layers x Lp x K/V heads x head
    dim, fp32, on the one-level schedule of the tiny preset)."""
    cp1 = reference[name]["figures"]
    for result in cp2:
        figures = result[name]["figures"]
        assert figures == cp1
        assert figures["tokens_computed"] == figures["tokens_unique"] + (
            sum(figures["prefix_lens"]) if name == "recomputed" else 0)
    assert len(reference["chunked"]["figures"]["prefix_lens"]) == 1
    assert reference["chunked"]["figures"]["num_shared_blocks"] > 2  # chunks and sub-trees
    if name in ("one_level", "recomputed"):
        (prefix_len,) = cp1["prefix_lens"]
        head_dim = PRESET.hidden_size // PRESET.num_attention_heads
        assert cp1["held_bytes"] == (2 * 2 * PRESET.num_layers * prefix_len
                                     * PRESET.num_query_groups * head_dim * 4)


@pytest.mark.parametrize("name", [*CASES, *CONTROLS])
def test_every_micro_batch_is_split_over_the_cp_ranks(cp2, reference, name):
    """Each rank ran half of every micro-batch's rows: one K and one V all-gather per layer
    and forward (a block's at record time, and again when recomputed), nothing more; under
    megatron's activation recompute a replayed layer gathers again."""
    figures = reference[CONTROLS.get(name, name)]["figures"]
    _, recompute, preset, settings = CASES[CONTROLS.get(name, name)]
    forwards = figures["num_micro_batches"] + (figures["num_shared_blocks"] if recompute else 0)
    for result in cp2:
        gathered = result[name]["gathered_rows"]
        assert all(2 * local == whole for local, whole in gathered)
        if settings:
            assert len(gathered) > 2 * preset.num_layers * forwards
        else:
            assert len(gathered) == 2 * preset.num_layers * forwards


def _tp2_job(rank: int) -> dict:
    """At CP=2 x TP=2: the one-level case without sequence parallelism, the chunked one with
    it (each CP slice split again over TP)."""
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross

    runs = {}
    for name, sequence_parallel in (("one_level", False), ("chunked", True)):
        budget, _, preset, settings = CASES[name]
        model = _build(preset, settings)("shared", sequence_parallel=sequence_parallel)
        cross = forward_backward_cross(model, _group(), budget, CONFIG)
        runs[name] = {"run": cross.run, "figures": cross.report()}
    return runs


def test_cp2_tp2_equals_the_stock_step_on_the_same_split(reference):
    """Each rank keeps its K/V heads' prefix, whole over CP; the gradients gathered over TP
    and averaged over CP equal the stock step's at CP=1, TP=1."""
    ranks = run_distributed(_tp2_job, 4, tp=2, cp=2, timeout=900)
    head_dim = PRESET.hidden_size // PRESET.num_attention_heads
    for rank, result in enumerate(ranks):
        for name, run in result.items():
            compared = _compared(run["run"], reference[name])
            verdict = within_tolerance(compared["vs_reference"], compared["plain"],
                                       torch.float32)
            assert all(verdict.values()), (rank, name, compared["vs_reference"].max_rel_diff)
            for q, d in compared["vs_plain"].max_rel_diff.items():
                assert d <= FP32_RTOL, f"CP x TP rank {rank} {name}: {q}: {d}"
        (prefix_len,) = result["one_level"]["figures"]["prefix_lens"]
        assert result["one_level"]["figures"]["held_bytes"] == (
            2 * 2 * PRESET.num_layers * prefix_len * PRESET.num_query_groups // 2 * head_dim * 4)


@pytest.mark.parametrize("control", CONTROLS)
def test_the_controls_fail_on_the_gradients(cp2, reference, control):
    for result in cp2:
        run = _compared(result[control]["run"], reference[CONTROLS[control]])
        verdict = within_tolerance(run["vs_reference"], run["plain"], torch.float32)
        assert not verdict["grads"]
        assert verdict["log_probs"] and verdict["loss"]  # the forward is untouched


MOE_CASES = {  # name: test_cross_micro_batch.MOE_VARIANTS' variant, recompute_prefix
    "losses": ("losses", False), "expert_bias": ("expert_bias", False),
    "losses_recomputed": ("losses", True),
    # control: megatron's own z-loss, each rank's mean over the plain rows it routes
    "per_rank_z_loss": ("losses", False),
}


def _moe_job(rank: int, names: list[str]) -> dict:
    """The GRPO group of ``test_cross_micro_batch``'s MoE test (a 41-token prompt, 6
    responses) under a 70-token budget on the tiny MoE preset, per case: the cross run and its
    router statistics on this rank; at CP=1 also megatron's stock step on its split."""
    from megatron.core.transformer.moe.router import TopKRouter

    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import gpt_model
    from prefix_sharing.workloads import make_workload

    from ._router_statistics import reset_router_statistics, router_statistics, routers
    from .test_cross_micro_batch import MOE, MOE_VARIANTS

    seqs = make_workload("grpo", num_prompts=1, group_size=6, prompt_len=(40, 41),
                         response_len=(12, 24), vocab_size=MOE.vocab_size, seed=5).sequences
    report = {}
    for name in names:
        variant, recompute = MOE_CASES[name]

        def build(layout: str, settings=MOE_VARIANTS[variant], **overrides):
            return gpt_model(MOE, layout=layout, **settings, **overrides)

        model = build("shared")
        if name == "per_rank_z_loss":
            for router in routers(model):
                router.apply_z_loss = functools.partial(TopKRouter.apply_z_loss, router)
        reset_router_statistics(model)
        cross = forward_backward_cross(model, seqs, 70, CONFIG, recompute_prefix=recompute)
        report[name] = {"run": cross.run, "statistics": router_statistics(model),
                        "figures": cross.report()}
        if torch.distributed.get_world_size() == 1:
            (plain, stats), (reference, _) = _split_runs(build, seqs, cross)
            report[name].update(plain=plain, plain_statistics=stats, reference=reference)
    return report


@pytest.fixture(scope="module")
def moe_cp2() -> tuple[dict, list[dict]]:
    names = [n for n in MOE_CASES if n != "per_rank_z_loss"]
    reference = run_distributed(_moe_job, 1, names, timeout=600)[0]
    return reference, run_distributed(_moe_job, 2, list(MOE_CASES), cp=2, timeout=900)


def _statistics_differences(ranks: list[dict], plain: dict) -> dict[str, float]:
    """Each router statistic of the CP ranks against the stock step's at CP=1: per-rank
    shares (the logged losses, the expert-bias counts) summed over the CP group as megatron's
    logging and ``finalize_model_grads`` sum them; the global counts already whole."""
    differences = {}
    for key, value in plain.items():
        share = key.startswith("tracker.") or key.endswith(".tokens_per_expert")
        ours = sum(r["statistics"][key] for r in ranks) if share else ranks[0]["statistics"][key]
        differences[key] = max_rel_diff(ours, value)
    return differences


@pytest.mark.parametrize("name", [n for n in MOE_CASES if n != "per_rank_z_loss"])
def test_moe_router_statistics_at_cp2_equal_the_stock_step_at_cp1(moe_cp2, name):
    """Every suffix micro-batch's statistics are its plain micro-batch's, split over the CP
    ranks as megatron's stock router splits them (each plain token's z-loss weight its CP=1
    one): outputs, loss, every gradient (the routers' carry the prefix copies' aux and z-loss
    terms) and every router statistic, on both ranks."""
    reference, ranks = moe_cp2
    case = reference[name]
    for rank, result in enumerate(ranks):
        run = _compared(result[name]["run"], case)
        verdict = within_tolerance(run["vs_reference"], run["plain"], torch.float32)
        assert all(verdict.values()), (rank, run["vs_reference"].max_rel_diff)
        for q, d in run["vs_plain"].max_rel_diff.items():
            assert d <= FP32_RTOL, f"CP rank {rank} {name}: {q}: {d} from the plain fp32 run"
        assert result[name]["figures"] == case["figures"]
    differences = _statistics_differences([r[name] for r in ranks], case["plain_statistics"])
    assert "tracker.z_loss" in differences and "tracker.load_balancing_loss" in differences
    assert all(d <= FP32_RTOL for d in differences.values()), differences


def test_moe_control_with_megatrons_per_rank_z_loss_fails(moe_cp2):
    reference, ranks = moe_cp2
    case = reference["losses"]
    differences = _statistics_differences([r["per_rank_z_loss"] for r in ranks],
                                          case["plain_statistics"])
    assert differences["tracker.z_loss"] > 1e-3
    for result in ranks:
        run = _compared(result["per_rank_z_loss"]["run"], case)
        assert not within_tolerance(run["vs_reference"], run["plain"], torch.float32)["grads"]
