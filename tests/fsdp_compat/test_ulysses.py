"""Ulysses around the sharing attention, on gloo ranks: each rank's rows of the attention
output and of every input gradient equal the single-process ``prefix_attention`` over the whole
flat layout, and every rank gets every position's log-probs and entropy as ``token_log_probs``
gives them (the logits' gradient scaled by the group size, as verl's gather scales it).

2 ranks over the tiny preset's 4 query heads / 2 K/V heads; 4 ranks repeat each K/V head twice.
The control: repeating the K/V heads tiled (``[0 1 0 1]``) instead of in place (``[0 0 1 1]``)
hands ranks 1 and 2 the wrong K/V head, and the comparison fails.
"""

from __future__ import annotations

import functools

import pytest
import torch

from prefix_sharing.attention import prefix_attention
from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff
from prefix_sharing.logprobs import token_log_probs
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import make_workload

from ._launch import run_gloo

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 8, 32


def rank_runs(rank: int, size: int) -> dict[str, dict[str, float]]:
    """:func:`rank_run`, and with 4 ranks its control (K/V heads tiled) too."""
    from prefix_sharing.fsdp_compat import ulysses

    runs = {"exact": rank_run(size)}
    if size == 4:
        stock = ulysses.repeat_kv_heads
        ulysses.repeat_kv_heads = lambda x, r: x if r == 1 else x.repeat(1, r, 1)
        try:
            runs["control"] = rank_run(size)
        finally:
            ulysses.repeat_kv_heads = stock
    return runs


def rank_run(size: int) -> dict[str, float]:
    """Relative errors of this rank's rows against the single-process reference."""
    from prefix_sharing.fsdp_compat import ulysses

    torch.manual_seed(0)  # every rank draws the same tensors
    workload = make_workload("tree", vocab_size=VOCAB, seed=1)
    plan = build_plan(workload.sequences, PrefixSharingConfig(min_prefix_len=1),
                      pad_to_multiple_of=size)
    rows = plan.num_tokens_flat
    q, weight = torch.randn(rows, HEADS, HEAD_DIM), torch.randn(rows, HEADS, HEAD_DIM)
    k, v = torch.randn(rows, KV_HEADS, HEAD_DIM), torch.randn(rows, KV_HEADS, HEAD_DIM)
    logits = torch.randn(rows, VOCAB)
    lp_weight, ent_weight = torch.randn(plan.num_tokens_total), torch.randn(plan.num_tokens_total)

    split = ulysses.ulysses_split(plan, torch.distributed.group.WORLD)
    own = split.rows.rows
    errors = {}

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    (prefix_attention(*full, plan) * weight).sum().backward()
    local = [own(x).clone().requires_grad_() for x in (q, k, v)]
    out = ulysses.ulysses_attention(*local, plan, split)
    (out * own(weight)).sum().backward()
    reference = prefix_attention(*full, plan)
    errors["attention"] = max_rel_diff(out, own(reference))
    for name, mine, ref in zip("qkv", local, full):
        errors[f"d{name}"] = max_rel_diff(mine.grad, own(ref.grad))

    full_logits = logits.clone().requires_grad_()
    ref = token_log_probs(full_logits, plan, temperature=0.7)
    (ref.log_probs * lp_weight + ref.entropy * ent_weight).sum().backward()
    local_logits = own(logits).clone().requires_grad_()
    stats = ulysses.ulysses_token_stats(local_logits, plan, split, temperature=0.7)
    (stats.log_probs * lp_weight + stats.entropy * ent_weight).sum().backward()
    errors["log_probs"] = max_rel_diff(stats.log_probs, ref.log_probs)
    errors["entropy"] = max_rel_diff(stats.entropy, ref.entropy)
    errors["dlogits"] = max_rel_diff(local_logits.grad / size, own(full_logits.grad))
    return errors


@functools.cache
def launched(size: int) -> list[dict[str, dict[str, float]]]:
    return run_gloo(rank_runs, size, size, timeout=120)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_gets_the_single_process_attention_and_log_probs(size):
    for rank, runs in enumerate(launched(size)):
        assert all(e <= FP32_RTOL for e in runs["exact"].values()), (rank, runs["exact"])


def test_control_tiled_kv_heads_break_it():
    errors = [runs["control"] for runs in launched(4)]
    assert max(e["attention"] for e in errors) > 1e-2
    assert all(e["log_probs"] <= FP32_RTOL for e in errors)  # the logits path is untouched
