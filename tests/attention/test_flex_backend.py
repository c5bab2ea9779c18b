"""FlexAttention: the plan's tree as one masked call over the flat rows (execution
"tree_mask"), and plain varlen segments as a mask. The masks are checked against the rows the
gather would copy for each query; outputs and log-sum-exps against the einsum reference with
torch's own (eager, forward-only) FlexAttention on CPU; gradients with a CPU implementation of
FlexAttention's documented semantics in its place (torch 2.13 has no CPU backward)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention import flex_backend, prefix_attention, varlen_attention
from prefix_sharing.attention.sources import key_rows
from prefix_sharing.errors import UnsupportedSetup
from tests.attention import fake_kernels
from tests.attention.test_prefix_attention import HEADS, projections, qkv
from tests.attention.test_sources import (_reference_of_rows, _worst, _suffixes_and_stored,
                                          plain_with)
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
# eager FlexAttention on CPU warns that it materializes every score: what these tests want
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")


def _visible_rows(plan, window):
    """For each flat row, the flat rows it reads: its segment's keys as the gather copies them
    (kv_gather_index), up to its own position, the last ``window`` of them."""
    q, kv, index = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host, plan.kv_gather_index
    visible = torch.zeros(plan.num_tokens_flat, plan.num_tokens_flat, dtype=torch.bool)
    for qs, qe, ks, ke in zip(q[:-1], q[1:], kv[:-1], kv[1:]):
        for t in range(qe - qs):
            last = ke - (qe - qs) + t  # bottom-right: the query's own key
            first = ks if window is None else max(ks, last - window + 1)
            visible[qs + t, index[first:last + 1]] = True
    return visible


@settings(max_examples=40, deadline=None)
@given(seqs=forests(max_new_tokens=6), window=st.sampled_from([None, 1, 2, 3, 40]))
def test_the_tree_mask_admits_exactly_the_rows_the_gather_copies(seqs, window):
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=4)
    mask = flex_backend.plan_flex_mask(plan, window)
    rows = plan.num_tokens_flat
    dense = create_mask(mask.mask_mod, 1, 1, rows, rows, device="cpu")[0, 0]
    assert torch.equal(dense, _visible_rows(plan, window))


@settings(max_examples=40, deadline=None)
@given(seqs=forests(max_new_tokens=6), window=st.sampled_from([None, 1, 2, 3, 40]))
def test_out_and_lse_of_the_tree_mask_equal_the_einsum_reference(seqs, window):
    """torch's own FlexAttention (eager, CPU, forward): every computed row's output and
    log-sum-exp over its whole sequence (empty tails, strict prefixes, duplicates), K/V of the
    flat rows read in place."""
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=4)
    token, position, w = projections()
    with torch.no_grad():
        q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    out, lse = flex_backend.flex_rows_attention(q, k, v, flex_backend.plan_flex_mask(plan, window))
    want_out, want_lse = _reference_of_rows(plan, q, k, v, window)
    assert lse.shape == (HEADS, plan.num_tokens_flat) and lse.dtype == torch.float32
    assert _worst([plan.restore(out), plan.restore(lse.t()).double()],
                  [want_out, want_lse]) < 1e-6  # lse is float32


@settings(max_examples=30, deadline=None)
@given(seqs=forests(max_new_tokens=6), window=st.sampled_from([None, 1, 3, 40]))
def test_varlen_segments_as_a_mask_equal_the_torch_kernel(seqs, window):
    """A plain varlen call (each segment over its gathered keys, bottom-right, fewer queries
    than keys) on FlexAttention."""
    plan = build_plan(seqs, EVERY_PREFIX)
    token, position, w = projections()
    with torch.no_grad():
        q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
        k, v = k.index_select(0, plan.kv_gather_index), v.index_select(0, plan.kv_gather_index)
        args = (q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_kv, plan.max_seqlen_q,
                plan.max_seqlen_kv)
        got = varlen_attention(*args, window=window, backend="flex")
        want = varlen_attention(*args, window=window, backend="torch")
    assert _worst([got], [want]) < 1e-10


@pytest.mark.parametrize("window", [None, 2])
def test_gradients_through_the_tree_mask_are_the_plain_attentions(monkeypatch, window):
    """prefix_attention(backend="flex") with FlexAttention's documented semantics in place of
    the CPU op (which has no backward): output and every gradient equal the whole sequences'
    attention (through the projections: q, k, v of shared rows included)."""
    monkeypatch.setattr(flex_backend, "_flex_attention", lambda device: fake_kernels.flex_attention)
    seqs = [[1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 0], [1, 2, 3, 5, 5], [1, 2, 3, 5, 5], [1, 2]]
    plan = build_plan(seqs, EVERY_PREFIX)
    assert key_rows(plan, backend="flex").execution == "tree_mask"
    token, position, w = projections()
    q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    out = plan.restore(prefix_attention(q, k, v, plan, window=window, backend="flex"))
    ref_token, ref_position, _ = projections()
    want, _ = plain_with(ref_token, ref_position, w, seqs, None, window)
    grad = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (token, position), grad)
    assert _worst([out], [want]) < 1e-10
    assert _worst(got, torch.autograd.grad(want, (ref_token, ref_position), grad)) < 1e-10


def test_the_tree_mask_holds_the_computed_rows_and_skips_unread_blocks():
    """K/V held: the flat rows. The block mask computes no block of keys its queries do not
    read: a GRPO group's tails read the prompt and themselves, not each other."""
    seqs = [[7] * 300 + [i] * 100 for i in range(4)]  # a 300-token prompt, 4 tails of 100
    plan = build_plan(seqs, PrefixSharingConfig())
    rows = key_rows(plan, backend="flex")
    assert (rows.execution, rows.kv_rows) == ("tree_mask", plan.num_tokens_flat)
    mask = flex_backend.plan_flex_mask(plan).block_mask
    q_blocks = -(-plan.num_tokens_flat // flex_backend.BLOCK_SIZE)
    causal_blocks = q_blocks * (q_blocks + 1) // 2
    computed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    assert computed < causal_blocks


def test_sinks_and_stored_rows_on_flex():
    """FlexAttention has no sink term: refused by name. A suffix over stored blocks is not
    one mask over its flat rows: the gather (the stored K/V concatenated in front) runs on
    FlexAttention's varlen mask instead, with the gather's result."""
    plan = build_plan([[1, 2, 3, 4], [1, 2, 3, 5]], EVERY_PREFIX)
    token, position, w = projections()
    with torch.no_grad():
        q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
        with pytest.raises(UnsupportedSetup, match=r"\[kernels\.sinks\]"):
            prefix_attention(q, k, v, plan, backend="flex", sinks=torch.zeros(HEADS))
        with pytest.raises(ValueError, match="tree_mask"):
            prefix_attention(q, k, v, plan, backend="torch", execution="tree_mask")
    for suffix, stored in _suffixes_and_stored()[:1]:
        assert key_rows(suffix, backend="flex").execution == "gather"
        with torch.no_grad():
            q, k, v = qkv(token, position, w, suffix.input_ids, suffix.position_ids)
            got = prefix_attention(q, k, v, suffix, backend="flex", stored=stored)
            want = prefix_attention(q, k, v, suffix, backend="torch", stored=stored)
        assert _worst([got], [want]) < 1e-10
