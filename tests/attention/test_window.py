"""Sliding windows and sinks under sharing: a plan's flat layout (with trimmed gathers) attends
exactly like each whole sequence with the same window and sinks, computed plainly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention import prefix_attention
from prefix_sharing.attention.window import windowed_keys
from tests.attention.test_prefix_attention import HEADS, projections, qkv
from tests.strategies import forests


def plain_attention(q, k, v, window, sinks):
    """One whole sequence, written out: query p reads keys max(0, p - window + 1) .. p, and
    the softmax denominator gains exp(sink) per head. q [n, h, d], k/v [n, hk, d]."""
    n, group = q.size(0), q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.size(-1) ** -0.5
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= p) & ((j > p - window) if window else True)
    weights = scores.masked_fill(~allowed, float("-inf")).exp()
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.exp()[:, None, None]
    return torch.einsum("hqk,khd->qhd", weights / denominator, v)


@settings(max_examples=60, deadline=None)
@given(forests(max_new_tokens=6), st.sampled_from([None, 1, 2, 3, 5, 40]), st.booleans())
def test_windowed_sharing_equals_plain_per_sequence_attention(seqs, window, with_sinks):
    token, position, w = projections()
    sinks = torch.randn(HEADS, dtype=torch.float64, requires_grad=True) if with_sinks else None
    plain = torch.cat([
        plain_attention(*qkv(token, position, w, torch.tensor(s), torch.arange(len(s))),
                        window, sinks)
        for s in seqs
    ])
    plan = build_plan(seqs, PrefixSharingConfig(min_prefix_len=1), pad_to_multiple_of=4)
    flat = prefix_attention(*qkv(token, position, w, plan.input_ids, plan.position_ids), plan,
                            window=window, sinks=sinks)
    shared = plan.restore(flat)
    torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)

    leaves = (token, position) + ((sinks,) if with_sinks else ())
    grad = torch.randn_like(plain)
    for a, b in zip(torch.autograd.grad(shared, leaves, grad),
                    torch.autograd.grad(plain, leaves, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_trimmed_gather_of_the_documented_example():
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]],
                      PrefixSharingConfig(min_prefix_len=1))
    keys = windowed_keys(plan, 2)
    assert keys.kv_gather_index.tolist() == [0, 1, 2, 3, 2, 4, 5]
    assert keys.cu_seqlens_kv.tolist() == [0, 4, 7] and keys.cu_seqlens_kv_host == (0, 4, 7)
    assert keys.cu_seqlens_kv.dtype == torch.int32 and keys.max_seqlen_kv == 4
    assert windowed_keys(plan, 2) is keys  # once per plan and window, for every layer


def test_branch_point_inside_the_window_keeps_the_prefix_keys_it_reaches():
    # b branches after 6 shared tokens; window 4: its first query (position 6) reads 3..6
    plan = build_plan([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9, 9]],
                      PrefixSharingConfig(min_prefix_len=1))
    keys = windowed_keys(plan, 4)
    assert keys.kv_gather_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 7, 8]
    assert keys.cu_seqlens_kv_host == (0, 7, 12)


def test_a_window_longer_than_every_sequence_trims_nothing():
    plan = build_plan([[1, 2, 3], [1, 2, 4, 5]], PrefixSharingConfig(min_prefix_len=1))
    keys = windowed_keys(plan, 10)
    assert keys.kv_gather_index is plan.kv_gather_index
    assert keys.cu_seqlens_kv is plan.cu_seqlens_kv


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_without_keys_is_refused(window):
    plan = build_plan([[1, 2, 3], [1, 2, 4]], PrefixSharingConfig(min_prefix_len=1))
    with pytest.raises(ValueError, match="at least one key"):
        windowed_keys(plan, window)


def test_sinks_need_one_logit_per_head():
    plan = build_plan([[1, 2, 3], [1, 2, 4]], PrefixSharingConfig(min_prefix_len=1))
    q = torch.zeros(plan.num_tokens_flat, HEADS, 8)
    with pytest.raises(ValueError, match=f"one logit per query head, shape \\({HEADS},\\)"):
        prefix_attention(q, q, q, plan, sinks=torch.zeros(HEADS + 1))
