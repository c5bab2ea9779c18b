"""Multi-latent attention under context parallelism: ``tiny-mla`` shared at CP=2 computes what
megatron's stock MLA spec computes at CP=1 on the padded batch.

The stock model runs on one rank; then two ranks form one CP group and run the shared model,
each rank its half of the plan's rows: its slice of the per-token rotary table (absolute
positions), the per-head K (24 channels) and V (16) all-gathered over CP, dK / dV
reduce-scattered back. GRPO, tree and agent micro-batches. Compared: logits, log-probs,
entropy, loss, every gradient, and - ``tiny-mla`` being MoE with sigmoid scores and an expert
bias - the router statistics megatron keeps (the aux loss it logs, the expert-bias token counts
and the bias update they give), the per-rank shares summed over the CP group as megatron's
logging and ``finalize_model_grads`` sum them; fp32, 1e-5 relative. A rotary table not sliced
to the rank's rows (every rank rotating its rows at the first rank's positions) must move the
tree micro-batch's log-probs.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from prefix_sharing.engines.megatron import compare, forward_backward, gpt_model
from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff, same_keys
from prefix_sharing.presets import PRESETS, sharp

from ._distributed import run_distributed
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches
from .test_context_parallel_moe import _per_rank_share
from .test_moe import _statistics_run

PRESET = sharp(PRESETS["tiny-mla"])
WORKLOADS = ["grpo", "tree", "agent"]


def _first_rank_positions(self: Any, table: torch.Tensor) -> torch.Tensor:
    """The wrong construction: the table's rows at the first CP rank's positions."""
    return table.index_select(0, self.plan.position_ids[: self.cp.num_rows])


def _plain_job(rank: int) -> tuple:
    return _statistics_run(gpt_model(PRESET, layout="padded"), micro_batches(WORKLOADS), "padded")


def _shared_job(rank: int, plain: tuple) -> dict:
    from megatron.core import parallel_state

    from prefix_sharing.megatron_ext.packed_seq import PlanPackedSeqParams

    batches = micro_batches(WORKLOADS)
    group = parallel_state.get_context_parallel_group()
    report = {}
    run, stats = _statistics_run(gpt_model(PRESET, layout="shared"), batches, "shared",
                                 SHARE_EVERY_PREFIX)
    for key, value in stats.items():
        if _per_rank_share(key):
            torch.distributed.all_reduce(value, group=group)
    same_keys(stats, plain[1], "router statistics")
    report["shared"] = {**compare(run, plain[0]).max_rel_diff,
                        **{k: max_rel_diff(v, plain[1][k]) for k, v in stats.items()}}
    # the wrong construction, on the tree micro-batch (log-probs are complete on every rank)
    with mock.patch.object(PlanPackedSeqParams, "per_token_rotary", _first_rank_positions):
        wrong = forward_backward(gpt_model(PRESET, layout="shared"), batches[1:2], "shared",
                                 SHARE_EVERY_PREFIX)
    report["unsliced_table_log_probs"] = max_rel_diff(wrong.outputs[0].log_probs,
                                                      plain[0].outputs[1].log_probs)
    report["statistics"] = sorted(k for k, v in plain[1].items() if v.abs().sum() > 0)
    report["grads"] = len(plain[0].grads)
    return report


@pytest.fixture(scope="module")
def cp2() -> list[dict]:
    plain = run_distributed(_plain_job, 1, timeout=600)[0]
    return run_distributed(_shared_job, 2, plain, cp=2, timeout=900)


def test_cp2_shared_mla_equals_the_stock_mla_at_cp1(cp2):
    for rank, report in enumerate(cp2):
        assert report["grads"] > 30  # every parameter of the 3 layers, experts included
        # the aux loss and each MoE layer's expert-bias counts and update are compared
        assert {"tracker.load_balancing_loss", "layer0.tokens_per_expert",
                "layer1.expert_bias_update"} <= set(report["statistics"]), report["statistics"]
        worst = {q: d for q, d in report["shared"].items() if d > FP32_RTOL}
        assert not worst, f"CP rank {rank}: {worst}"


def test_a_rotary_table_not_sliced_to_the_ranks_rows_is_caught(cp2):
    assert all(report["unsliced_table_log_probs"] > 1e-3 for report in cp2), cp2
