"""FSDP2 on 2 gloo ranks, each on its own micro-batch: the shared step equals the plain one
(outputs per rank, gradients reduced over both), with and without gradient checkpointing."""

from __future__ import annotations

import pytest

from prefix_sharing.equivalence import within_tolerance

from ._fsdp_jobs import fsdp_equivalence_job, fsdp_hybrid_job, fsdp_vlm_job
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


@pytest.mark.parametrize("family, preset, recurrent_layers", [
    ("qwen3_5_text", "tiny-hybrid", 3), ("nemotron_h", "tiny-nemotron-h", 2)])
def test_fsdp2_hybrid_model_with_checkpointing_matches_the_plain_step(family, preset,
                                                                      recurrent_layers):
    """Qwen3.5- and Nemotron-H-shaped: the sharing GDN modules / Mamba-2 mixers survive
    fully_shard and checkpointing. In float64, so the fixed 1e-5 rule applies (in float32 the
    recurrence's own rounding exceeds it, see test_gated_deltanet.py)."""
    if family == "nemotron_h":
        pytest.importorskip("transformers.models.nemotron_h")
    ranks = run_gloo(fsdp_hybrid_job, 2, family, preset, timeout=300)
    for rank, (comparison, calls) in enumerate(ranks):
        assert all(within_tolerance(comparison).values()), (rank, comparison.max_rel_diff)
        assert calls == recurrent_layers * 2


def test_fsdp2_vision_language_model_with_checkpointing_matches_the_plain_step():
    """Qwen3-VL (deepstack) with its vision blocks and decoder layers sharded: the images go
    through the root forward, so FSDP gathers the vision tower as in a stock call; float64."""
    import transformers

    from prefix_sharing.fsdp_compat.vlm import MIN_TRANSFORMERS

    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
        pytest.skip("vision-language models need transformers >= 5.10")
    ranks = run_gloo(fsdp_vlm_job, 2, "qwen3_vl", timeout=300)
    for rank, (comparison, images_computed) in enumerate(ranks):
        assert all(within_tolerance(comparison).values()), (rank, comparison.max_rel_diff)
        assert images_computed == rank + 1  # one shared image; two different ones
