"""FSDP2 on 2 gloo ranks, each on its own micro-batch: the shared step equals the plain one
(outputs per rank, gradients reduced over both), with and without gradient checkpointing."""

from __future__ import annotations

from prefix_sharing.equivalence import within_tolerance

from ._fsdp_jobs import fsdp_equivalence_job
from ._launch import run_gloo
from ._models import PRESET


def test_fsdp2_two_ranks_with_and_without_checkpointing_match_the_plain_step():
    ranks = run_gloo(fsdp_equivalence_job, 2, "llama", timeout=300)
    for rank, results in enumerate(ranks):
        for checkpointing, (comparison, attention_calls) in results.items():
            assert all(within_tolerance(comparison).values()), (rank, checkpointing,
                                                                comparison.max_rel_diff)
            # checkpointing replays every layer in backward, with the plan in its keywords
            assert attention_calls == PRESET.num_layers * (2 if checkpointing else 1)
