"""MoE under context parallelism: the router's batch statistics over the whole CP group.

The shared ``tiny-moe`` model split over two CP ranks against megatron's stock local spec on the
padded batch at CP=1 (same weights): logits, log-probs, entropy, loss, every gradient (the
router's carry the aux and z-loss terms), and the router statistics - the aux, sequence-aux,
global-aux and z-loss values megatron logs, the expert-bias token counts and the bias update
they give, the global aux counts. Per-rank shares (the logged losses, the expert-bias counts)
are summed over the CP group as megatron's logging and ``finalize_model_grads`` sum them; the
global aux counts and the bias update are already global. GRPO, tree, agent and no sharing;
fp32, 1e-5 relative. A router whose load-balancing counts are not reduced over CP (each rank's
its own), and megatron's own z-loss (each rank's mean over its tokens, which is the CP=1 mean
only when the ranks hold as many real tokens), must fail the checks.
"""

from __future__ import annotations

import functools

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter

from prefix_sharing.engines.megatron import compare, gpt_model
from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff, same_keys

from ._distributed import run_distributed
from .test_moe import (
    PRESET,
    SHARE_EVERY_PREFIX,
    STATISTICS,
    VARIANTS,
    _statistics_run,
    micro_batches,
    stock_spec_with_masked_bias_counts,
)

CP_VARIANTS = ["preset", "expert_bias"]  # every loss and the z-loss; sigmoid + expert bias


def _per_rank_share(name: str) -> bool:
    """Statistics each rank holds its share of (summed over the group by megatron)."""
    return name.startswith("tracker.") or name.endswith(".tokens_per_expert")


def _plain_job(rank: int) -> dict:
    report = {}
    for name in CP_VARIANTS:
        stock = gpt_model(PRESET, layout="padded", **VARIANTS[name],
                          layer_spec=stock_spec_with_masked_bias_counts(dict(
                              num_moe_experts=PRESET.num_experts)))
        report[name] = _statistics_run(stock, micro_batches(0), "padded")
    return report


# wrong constructions, run on the preset: its load-balancing counts reduced over TP (one rank)
# in place of TP x CP; megatron's own z-loss (each rank's mean over its own tokens)
WRONG = {"counts_not_reduced": lambda router: setattr(router, "tp_cp_group", router.tp_group),
         "per_rank_z_loss": lambda router: setattr(
             router, "apply_z_loss", functools.partial(TopKRouter.apply_z_loss, router))}


def _shared_job(rank: int) -> dict:
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    report = {}
    for name in [*CP_VARIANTS, *WRONG]:
        ours = gpt_model(PRESET, layout="shared", **VARIANTS.get(name, {}))
        for layer in ours.decoder.layers if name in WRONG else []:
            WRONG[name](layer.mlp.router)
        run, stats = _statistics_run(ours, micro_batches(0), "shared", SHARE_EVERY_PREFIX)
        for key, value in stats.items():
            if _per_rank_share(key):
                torch.distributed.all_reduce(value, group=group)
        report[name] = (run, stats)
    return report


@pytest.fixture(scope="module")
def plain():
    return run_distributed(_plain_job, 1, timeout=600)[0]


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_shared_job, 2, cp=2, timeout=900)


def _differences(shared: tuple, plain: tuple) -> dict[str, float]:
    (run, stats), (plain_run, plain_stats) = shared, plain
    same_keys(stats, plain_stats, "router statistics")
    return {**compare(run, plain_run).max_rel_diff,
            **{k: max_rel_diff(v, plain_stats[k]) for k, v in stats.items()}}


@pytest.mark.parametrize("variant", CP_VARIANTS)
def test_cp2_shared_moe_equals_the_stock_model_at_cp1(cp2, plain, variant):
    for rank, report in enumerate(cp2):
        stats = report[variant][1]
        assert STATISTICS[variant] <= set(stats), variant  # every statistic compared
        assert all(stats[k].abs().sum() > 0 for k in STATISTICS[variant]), variant
        worst = {q: d for q, d in _differences(report[variant], plain[variant]).items()
                 if d > FP32_RTOL}
        assert not worst, f"CP rank {rank} {variant}: {worst}"


@pytest.mark.parametrize("wrong, statistic", [("counts_not_reduced", "load_balancing_loss"),
                                               ("per_rank_z_loss", "z_loss")])
def test_wrong_constructions_are_caught(cp2, plain, wrong, statistic):
    differences = _differences(cp2[0][wrong], plain["preset"])
    assert differences[f"tracker.{statistic}"] > 1e-3, differences
    assert differences["grads"] > 1e-3, differences
