"""Context parallelism: the shared model split over CP ranks computes what the plain model does.

Each case runs GRPO, tree, agent and unshared micro-batches through megatron's schedule at
``context_parallel_size`` 2 or 4, alone or with TP=2 or PP=2 (shared layout: the plan's rows split
over the CP ranks, K/V gathered), with a sliding window and learned sinks at CP=2
and compares logits, log-probs, entropy, loss and every gradient with megatron's stock local
spec on padded input at CP=1, on the same weights (fp32, 1e-5 relative). Megatron's stock
attention refuses CP > 1, so the CP=1 plain run is the reference.
"""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.engines.megatron import compare, forward_backward
from prefix_sharing.equivalence import FP32_RTOL
from prefix_sharing.megatron_ext.context_parallel import kv_bytes_per_layer
from prefix_sharing.workloads import make_workload

from ._distributed import PRESET, run_distributed, tiny_gpt
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

WORKLOADS = ["grpo", "tree", "agent", "none"]
VARIANTS = {
    "llama": {},  # 4 query heads over 2 K/V groups
    "three_heads": dict(num_attention_heads=3, num_query_groups=1, kv_channels=16),  # 3 % CP != 0
    "sequence_parallel": dict(sequence_parallel=True),  # under TP: each CP slice split over TP
    # gpt-oss's attention on the tiny shape: a 3-key window on layer 1 of 2, learned sinks
    "window_sinks": dict(window_size=(2, 0), window_attn_skip_freq=2, softmax_type="learnable"),
}


def _batches() -> list[list[torch.Tensor]]:
    return micro_batches(WORKLOADS)


def _shared_job(rank: int, variants: list[str], local_keys_only: bool = False) -> dict:
    from prefix_sharing.megatron_ext import core_attention, prepare_micro_batch

    received = []  # bytes each K/V all-gather brought from the other ranks

    def counted(x, cp):
        out = gather_rows(x, cp)
        received.append((out.numel() - x.numel()) * x.element_size())
        return out

    gather_rows = core_attention.gather_rows
    core_attention.gather_rows = counted
    if local_keys_only:  # the wrong construction: each rank sees its own K/V in place of others'
        core_attention.gather_rows = lambda x, cp: x.repeat(cp.size, *[1] * (x.dim() - 1))
    mb = prepare_micro_batch(_batches()[0], SHARE_EVERY_PREFIX)
    runs = {}
    for v in variants:
        received.clear()
        runs[v] = forward_backward(tiny_gpt("shared", **VARIANTS[v]), _batches(), "shared",
                                   SHARE_EVERY_PREFIX)
        if v == "llama":
            llama_bytes = sum(received)
    flats = [prepare_micro_batch(b, SHARE_EVERY_PREFIX).plan.num_tokens_flat for b in _batches()]
    return {"runs": runs, "rows": (mb.input_ids.size(1), mb.plan.num_tokens_flat),
            "received": llama_bytes if "llama" in variants and not local_keys_only else None,
            "flats": flats}


def _plain_job(rank: int, variants: list[str]) -> dict:
    """At TP = 1, where sequence parallelism does not exist (and changes no result)."""
    return {v: forward_backward(tiny_gpt("padded", **{k: x for k, x in VARIANTS[v].items()
                                                     if k != "sequence_parallel"}),
                                _batches(), "padded")
            for v in variants}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_plain_job, 1, list(VARIANTS), timeout=600)[0]


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_shared_job, 2, ["llama", "three_heads", "window_sinks"], cp=2,
                           timeout=900)


@pytest.mark.parametrize("variant", ["llama", "three_heads", "window_sinks"])
def test_cp2_shared_equals_plain_cp1(cp2, reference, variant):
    for rank, result in enumerate(cp2):
        run = result["runs"][variant]
        diff = compare(run, reference[variant]).max_rel_diff
        worst = {q: d for q, d in diff.items() if d > FP32_RTOL}
        assert not worst, f"CP rank {rank} {variant}: {worst}"
        assert len(run.outputs) == len(WORKLOADS)


def test_the_window_changes_the_plain_model(reference, cp2):
    """Not vacuous: the windowed reference differs from the full-attention one (same weights
    but the sinks), and the CP ranks' sinks get gradients."""
    windowed, full = reference["window_sinks"].outputs, reference["llama"].outputs
    assert max((w.logits - f.logits).abs().max() for w, f in zip(windowed, full)) > 1e-3
    for result in cp2:
        sinks = [g for k, g in result["runs"]["window_sinks"].grads.items()
                 if k.endswith("softmax_offset")]
        assert len(sinks) == PRESET.num_layers and all(g.abs().sum() > 0 for g in sinks)


def test_each_cp_rank_holds_half_the_rows_of_the_same_plan(cp2):
    for result in cp2:
        local, flat = result["rows"]
        assert 2 * local == flat
    assert cp2[0]["runs"]["llama"].digests == cp2[1]["runs"]["llama"].digests


def test_bytes_received_are_the_documented_figure(cp2):
    """K and V of the other rank's rows, per layer (tiny: 2 layers, 2 K/V heads of 16, fp32)."""
    for result in cp2:
        expected = sum(kv_bytes_per_layer(flat, 2, 2, 16, 4) for flat in result["flats"])
        assert result["received"] == PRESET.num_layers * expected


def test_cp2_tp2_shared_equals_plain_cp1(reference):
    variants = ["llama", "sequence_parallel"]
    ranks = run_distributed(_shared_job, 4, variants, tp=2, cp=2, timeout=900)
    for rank, result in enumerate(ranks):
        for variant in variants:
            diff = compare(result["runs"][variant], reference[variant]).max_rel_diff
            worst = {q: d for q, d in diff.items() if d > FP32_RTOL}
            assert not worst, f"CP2 x TP2 rank {rank} {variant}: {worst}"


def test_cp4_shared_equals_plain_cp1(reference):
    ranks = run_distributed(_shared_job, 4, ["three_heads"], cp=4, timeout=900)
    for rank, result in enumerate(ranks):
        diff = compare(result["runs"]["three_heads"], reference["three_heads"]).max_rel_diff
        worst = {q: d for q, d in diff.items() if d > FP32_RTOL}
        assert not worst, f"CP4 rank {rank}: {worst}"
        local, flat = result["rows"]
        assert 4 * local == flat


def test_cp2_pp2_shared_equals_plain_cp1(reference):
    """Each stage holds its layers' gradients and the last stage the outputs."""
    ranks = run_distributed(_shared_job, 4, ["llama"], pp=2, cp=2, timeout=900)
    plain = reference["llama"]
    for rank, result in enumerate(ranks):
        run = result["runs"]["llama"]
        assert run.grads and set(run.grads) < set(plain.grads)  # this stage's parameters
        grads = {k: g for k, g in plain.grads.items() if k in run.grads}
        diff = compare(run, type(plain)(plain.outputs if run.outputs else [], grads,
                                         plain.digests)).max_rel_diff
        worst = {q: d for q, d in diff.items() if d > FP32_RTOL}
        assert not worst, f"CP2 x PP2 rank {rank}: {worst}"
    assert sum(bool(r["runs"]["llama"].outputs) for r in ranks) == 2  # the last stage's CP ranks


def test_attending_only_to_local_keys_is_caught(reference):
    ranks = run_distributed(_shared_job, 2, ["llama"], True, cp=2, timeout=900)
    diff = compare(ranks[0]["runs"]["llama"], reference["llama"]).max_rel_diff
    assert diff["logits"] > 1e-3 and diff["grads"] > 1e-3, diff


def test_a_17k_token_agent_micro_batch_passes_the_verdict_at_cp2():
    """18 agent episodes (2 tasks x 3 turns x 3 branches, a 256-token system prompt, turns of
    80-150 tokens): 17077 tokens, 9991 computed, against the plain run in float64."""
    from prefix_sharing.engines import get_engine
    from prefix_sharing.engines.verify import VerifyRequest

    w = make_workload("agent", vocab_size=PRESET.vocab_size, seed=0, num_tasks=2, num_turns=3,
                      branching=3, system_len=256, turn_len=(80, 150))
    request = VerifyRequest([(w.sequences, None)], SHARE_EVERY_PREFIX, PRESET)
    report, = get_engine("megatron").verify(request, cp=2)
    assert sum(map(len, w.sequences)) == 17077
    assert report["passed"] and report["vs_plain_within_fp32_rtol"], report
