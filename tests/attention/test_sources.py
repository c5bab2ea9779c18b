"""Attention over key sources: the (out, lse) contract against an einsum reference, the exact
LSE merge and its backward, K/V held at the computed size, no scatter, bitwise reruns."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention import merge, prefix_attention, varlen_attention
from prefix_sharing.attention.backends import get_lse_kernel
from prefix_sharing.attention.sources import key_rows, source_layout
from prefix_sharing.errors import UnsupportedSetup
from prefix_sharing.workloads import make_workload
from tests.attention.test_prefix_attention import DIM, HEADS, KV_HEADS, projections, qkv
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def einsum_reference(q, k, v, window, sinks):
    """One whole sequence written out: ``(out, lse)``, query p reading keys
    ``max(0, p - window + 1) .. p``, the sink in the denominator. q [n, h, d], k/v [n, hk, d];
    lse [n, h], natural log."""
    n, group = q.size(0), q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.size(-1) ** -0.5
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (j <= p) & ((j > p - window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, n, 1)], -1)
    lse = scores.logsumexp(-1)  # [h, n]
    probs = (scores - lse[..., None]).exp()[..., :n]
    return torch.einsum("hqk,khd->qhd", probs, v), lse.t()


def plain(seqs, window=None, sinks=None, seed=0):
    token, position, w = projections(seed)
    outs, lses = zip(*(einsum_reference(*qkv(token, position, w, torch.tensor(s),
                                              torch.arange(len(s))), window, sinks)
                       for s in seqs))
    return torch.cat(outs), torch.cat(lses)


@settings(max_examples=40, deadline=None)
@given(forests(max_new_tokens=6), st.sampled_from([None, 1, 3, 40]), st.booleans())
def test_out_and_lse_of_the_torch_kernel_equal_the_einsum_reference(seqs, window, with_sinks):
    """varlen_attention(return_lse=True) over each segment's gathered keys: every computed
    token's output and log-sum-exp are its whole sequence's (empty tails, strict prefixes,
    duplicates come from the forests; windows and sinks drawn)."""
    sinks = torch.randn(HEADS, dtype=torch.float64) if with_sinks else None
    want_out, want_lse = plain(seqs, window, sinks)
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=4)
    token, position, w = projections()
    q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    k, v = k.index_select(0, plan.kv_gather_index), v.index_select(0, plan.kv_gather_index)
    out, lse = varlen_attention(
        q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_kv, plan.max_seqlen_q, plan.max_seqlen_kv,
        window=window, sinks=sinks, backend="torch", return_lse=True)
    assert lse.shape == (HEADS, plan.num_tokens_flat) and lse.dtype == torch.float64
    torch.testing.assert_close(plan.restore(out), want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(plan.restore(lse.t()), want_lse, rtol=1e-10, atol=1e-10)


# backend -> (q/k/v dtype, tolerance of max|a - b| / max|b| against the float64 reference)
# float32 against the float64 reference (not two float32 runs, which the 1e-5 rule compares):
# a gradient summed in float32 over a node's readers (the sinks': over every row) rounds past
# 1e-5 relative on some forests (1.5e-5 seen); a misread statistics layout is off by > 0.1
SOURCE_KERNELS = {"torch": (torch.float64, 1e-10), "npu": (torch.float32, 5e-5)}


def _worst(got, want):
    return max(float((a - b).abs().max() / b.abs().max())
               for a, b in zip((x.detach() for x in got), (x.detach() for x in want)))


@pytest.mark.parametrize("backend", sorted(SOURCE_KERNELS))
@settings(max_examples=40, deadline=None)
@given(seqs=forests(max_new_tokens=6), with_sinks=st.booleans())
def test_attention_over_sources_equals_the_plain_forward_with_its_lse(backend, seqs,
                                                                      with_sinks):
    """The merged (out, lse) of own segments and shared nodes is the whole sequence's; the
    gradients too (q, k, v through the projections, and the sinks). torch_npu on its fake, in
    float32: the statistics read from and written back to its row layout (nodes' calls with
    queryless segments, first ones included, come from the forests)."""
    dtype, tol = SOURCE_KERNELS[backend]
    sinks = (torch.randn(HEADS, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
             .requires_grad_() if with_sinks else None)
    want_out, want_lse = plain(seqs, None, sinks)
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=4)
    token, position, w = projections()
    q, k, v = (x.to(dtype) for x in qkv(token, position, w, plan.input_ids, plan.position_ids))
    with pytest.MonkeyPatch.context() as monkeypatch:
        if backend != "torch":
            _install(monkeypatch, backend)
        out, lse = merge.attention_over_sources(q, k, v, source_layout(plan),
                                                get_lse_kernel(backend), sinks=sinks)
        ref_token, ref_position, _ = projections()
        want_grad_out, _ = plain_with(ref_token, ref_position, w, seqs, sinks)
        grad = torch.randn(want_grad_out.shape, dtype=want_grad_out.dtype,
                           generator=torch.Generator().manual_seed(1))
        leaves = (token, position) + ((sinks,) if with_sinks else ())
        ref_leaves = (ref_token, ref_position) + ((sinks,) if with_sinks else ())
        got = torch.autograd.grad(plan.restore(out).double(), leaves, grad)
    assert _worst([plan.restore(out).double(), plan.restore(lse.t()).double()],
                  [want_out, want_lse]) < tol
    assert _worst(got, torch.autograd.grad(want_grad_out, ref_leaves, grad)) < tol


def plain_with(token, position, w, seqs, sinks, window=None):
    outs, lses = zip(*(einsum_reference(*qkv(token, position, w, torch.tensor(s),
                                              torch.arange(len(s))), window, sinks)
                       for s in seqs))
    return torch.cat(outs), torch.cat(lses)


def test_the_layout_of_the_documented_example():
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]], EVERY_PREFIX)
    assert plan.prefix_runs_host == ((), ((0, 3),))
    own, nodes = source_layout(plan).parts
    assert own.causal and own.q_index is None and own.cu_seqlens_k_host == (0, 4, 6)
    assert not nodes.causal and nodes.q_index.tolist() == [4, 5]
    assert nodes.cu_seqlens_q_host == (0, 2, 2) and nodes.cu_seqlens_k_host == (0, 3, 6)
    assert source_layout(plan).slots.tolist() == [[2], [2], [2], [2], [0], [1]]


def test_a_tree_is_cut_into_its_edges():
    """Readers of different prefix lengths over one provider: each node is read whole."""
    plan = build_plan([[1, 2, 3, 4, 5], [1, 2, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8]], EVERY_PREFIX)
    nodes = source_layout(plan).parts[1]
    # nodes (0, 2) read by three one-token tails, (2, 3) by two, (3, 4) by one; rows 4..7
    # (the first path's last token and the three tails) by none
    assert nodes.cu_seqlens_k_host == (0, 2, 3, 4, 8)
    assert nodes.cu_seqlens_q_host == (0, 3, 5, 6, 6)


def test_a_slice_layout_of_the_documented_example():
    """Rows 4..5 of the documented plan (b's tail): b's own rows causally (a's rows 0..3 a
    queryless segment), and the node (0, 3) read by both rows."""
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]], EVERY_PREFIX)
    own, nodes = source_layout(plan, rows=(4, 6)).parts
    assert own.cu_seqlens_q_host == (0, 0, 2) and own.cu_seqlens_k_host == (0, 4, 6)
    assert nodes.q_index.tolist() == [0, 1] and nodes.cu_seqlens_k_host == (0, 3, 6)


@settings(max_examples=60, deadline=None)
@given(seqs=forests(max_new_tokens=6), window=st.sampled_from([None, 1, 2, 3, 5, 40]),
       ranks=st.integers(1, 4), with_sinks=st.booleans())
def test_slices_and_windows_over_sources_are_the_plain_attention(seqs, window, ranks,
                                                                 with_sinks):
    """Context parallelism's layout (``rows=``): each rank's slice of the flat rows attends
    over the K/V of every row in place (its peers' rows as sources, no gather; a segment and a
    node's readers cut anywhere by a slice come from the forests); ``ranks`` 1 is the whole
    layout. With a sliding window the own part takes it as its band, each node's readers keep
    the rows whose window reaches it, from their first key on. Output, log-sum-exp and
    gradients (through the projections, and the sinks), slices in rank order, are the whole
    sequences' plain (windowed) attention."""
    sinks = (torch.randn(HEADS, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
             .requires_grad_() if with_sinks else None)
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=4 * ranks)
    token, position, w = projections()
    q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    per_rank = plan.num_tokens_flat // ranks
    outs, lses = [], []
    for rank in range(ranks):
        rows = None if ranks == 1 else (rank * per_rank, (rank + 1) * per_rank)
        layout = source_layout(plan, rows=rows, window=window)
        assert layout.parts[0].cu_seqlens_k_host[-1] == plan.num_tokens_flat  # K/V in place
        lo, hi = rows or (0, plan.num_tokens_flat)
        out, lse = merge.attention_over_sources(q[lo:hi], k, v, layout,
                                                get_lse_kernel("torch"), sinks=sinks)
        outs.append(out)
        lses.append(lse)
    out, lse = plan.restore(torch.cat(outs)), plan.restore(torch.cat(lses, 1).t())
    ref_token, ref_position, _ = projections()
    want, want_lse = plain_with(ref_token, ref_position, w, seqs, sinks, window)
    grad = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(1))
    leaves = (token, position) + ((sinks,) if with_sinks else ())
    ref_leaves = (ref_token, ref_position) + ((sinks,) if with_sinks else ())
    got = torch.autograd.grad(out, leaves, grad)
    assert _worst([out, lse], [want, want_lse]) < 1e-10
    assert _worst(got, torch.autograd.grad(want, ref_leaves, grad)) < 1e-10


def test_a_window_bounds_each_reader_row_from_its_first_key():
    """The documented plan (``b``'s tail, positions 3 and 4, reads the node of positions 0..2).
    A window of 3: row 4 reads the node from key 1, row 5 from key 2; the node's keys start at
    key 1 (row 0 joins the gap before it) and each row carries its first key there, which
    flash-attn's one band per call cannot take: the gather serves it. A window of 2: row 5
    reaches none of the node and leaves the call, row 4 reads key 2 alone - no row bound is
    left, so it runs over sources on flash-attn too."""
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]], EVERY_PREFIX)
    own, nodes = source_layout(plan, window=3).parts
    assert own.causal and own.window == 3 and own.cu_seqlens_k_host == (0, 4, 6)
    assert nodes.q_index.tolist() == [4, 5] and nodes.first_key.tolist() == [0, 1]
    assert nodes.cu_seqlens_q_host == (0, 0, 2, 2) and nodes.cu_seqlens_k_host == (0, 1, 3, 6)
    assert key_rows(plan, window=3, backend="flash_attn").execution == "gather"
    assert key_rows(plan, window=3, backend="torch").execution == "sources"
    _, nodes = source_layout(plan, window=2).parts
    assert nodes.q_index.tolist() == [4] and nodes.first_key is None
    assert nodes.cu_seqlens_q_host == (0, 0, 1, 1) and nodes.cu_seqlens_k_host == (0, 2, 3, 6)
    assert key_rows(plan, window=2, backend="flash_attn").execution == "sources"


def _backward_at_own_states(kernel):
    """An injected bug: each part's backward at its *own* (out, lse), not the merged ones."""
    forward, backward = kernel

    def wrong(dout, q, k, v, out, lse, *args, **kwargs):
        own_out, own_lse = forward(q, k, v, *args, **kwargs)
        return backward(dout, q, k, v, own_out, own_lse, *args, **kwargs)

    return forward, wrong


@pytest.mark.parametrize("backend", sorted(SOURCE_KERNELS))
@pytest.mark.parametrize("kernel_of", [get_lse_kernel, lambda n: _backward_at_own_states(
    get_lse_kernel(n))], ids=["merged", "control_own_states"])
def test_each_part_is_differentiated_at_the_merged_state(monkeypatch, kernel_of, backend):
    dtype, tol = SOURCE_KERNELS[backend]
    if backend != "torch":
        _install(monkeypatch, backend)
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 0, 5], [1, 2, 0]]
    plan = build_plan(seqs, EVERY_PREFIX)
    token, position, w = projections()
    q, k, v = (x.to(dtype) for x in qkv(token, position, w, plan.input_ids, plan.position_ids))
    out, _ = merge.attention_over_sources(q, k, v, source_layout(plan), kernel_of(backend))
    ref_token, ref_position, _ = projections()
    want, _ = plain_with(ref_token, ref_position, w, seqs, None)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(plan.restore(out).double(), (token, position), grad)
    worst = _worst(got, torch.autograd.grad(want, (ref_token, ref_position), grad))
    if kernel_of is get_lse_kernel:
        assert worst < tol
    else:
        assert worst > 1e-3  # the test has power: the merged state matters


class _CountScatters(TorchDispatchMode):
    """aten ops that add into rows by index (a gather's backward)."""

    OPS = {torch.ops.aten.index_add.default, torch.ops.aten.index_add_.default,
           torch.ops.aten.scatter_add.default, torch.ops.aten.scatter_add_.default,
           torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.OPS
        return func(*args, **(kwargs or {}))


def _step(seqs, execution, seed=0, window=None):
    """One forward + backward of prefix_attention; the leaves' gradients."""
    plan = build_plan(seqs, EVERY_PREFIX)
    token, position, w = projections(seed)
    with torch.no_grad():
        q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    out = prefix_attention(*leaves, plan, execution=execution, window=window)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    with _CountScatters() as counter:
        grads = torch.autograd.grad(out, leaves, grad)
    return grads, counter.calls


TREE = [[1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 0], [1, 2, 3, 5, 5], [1, 2, 3, 5, 5], [1, 2]]


@pytest.mark.parametrize("execution, scatters", [("sources", 0), ("gather", 2)])
def test_the_backward_adds_into_no_rows_by_index(execution, scatters):
    """Sources: dK/dV are the parts' full-size gradients added in a fixed order; the gather
    (the control) scatter-adds K's and V's gradients into the flat rows."""
    assert _step(TREE, execution)[1] == scatters


@pytest.mark.parametrize("window", [None, 2])
def test_gradients_of_two_identical_runs_are_bitwise_equal(window):
    first, second = (_step(TREE, "sources", window=window) for _ in range(2))
    assert first[1] == second[1] == 0  # no scatter, with or without a window
    assert all(torch.equal(a, b) for a, b in zip(first[0], second[0]))


# small enough for the projections' 64 positions
WORKLOADS = {"grpo": dict(num_prompts=2, group_size=3, prompt_len=(6, 10), response_len=(3, 6)),
             "agent": dict(num_tasks=1, num_turns=2, system_len=8, task_len=(2, 4),
                           turn_len=(2, 4)),
             "tree": dict(depth=2, prompt_len=(6, 8), node_len=(2, 4))}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_kv_held_per_layer_is_the_computed_rows(name):
    """From the plan (key_rows) and measured: the K/V rows the attention holds (its inputs
    and the copies it makes), sources against the gather."""
    workload = make_workload(name, **WORKLOADS[name])
    plan = build_plan(workload.sequences, EVERY_PREFIX)
    rows = key_rows(plan)
    assert rows.execution == "sources" and rows.kv_rows == plan.num_tokens_flat
    windowed = key_rows(plan, window=4)  # each reader row from its first key in the window
    assert windowed.execution == "sources" and windowed.kv_rows == plan.num_tokens_flat
    gathered = key_rows(plan, window=4, backend="flash_attn")  # one band per call: gathered
    assert gathered.execution == "gather" and gathered.kv_rows > plan.num_tokens_flat

    token, position, w = projections()
    ids = plan.input_ids % 6  # the tiny projection's vocabulary
    held = {}
    for execution, window in (("sources", None), ("sources", 4), ("gather", None)):
        q, k, v = qkv(token, position, w, ids, plan.position_ids)
        held[execution, window] = _kv_rows_held(k, v, lambda: prefix_attention(
            q, k, v, plan, window=window, execution=execution))
    # K and V, each once, in place, with and without a window
    assert held["sources", None] == held["sources", 4] == 2 * plan.num_tokens_flat
    assert held["gather", None] == 2 * (plan.num_tokens_flat + plan.cu_seqlens_kv_host[-1])


class _KeyCopies(TorchDispatchMode):
    """Rows of the K/V-shaped tensors (``[n, KV_HEADS, DIM]``) ops produce: the copies of K
    and V a forward makes."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[1:] == (KV_HEADS, DIM):
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            self.rows += out.size(0) * (out.untyped_storage().data_ptr() not in inputs)  # views
        return out


def _kv_rows_held(k, v, run) -> int:
    """K/V rows a forward holds: its inputs' plus every copy it makes."""
    with _KeyCopies() as copies:
        run()
    return k.size(0) + v.size(0) + copies.rows


# ------------------------------------------------ flash-attn and torch_npu (CPU fakes)
# Their with-lse pairs are checked against the fakes written from the kernels' documentation
# (tests/attention/fake_kernels.py: flash-attn's softmax_lse; torch_npu's softmax_max /
# softmax_sum in their TND row layout and npu_fusion_attention_grad; Transformer Engine's
# fused_attn_fwd / fused_attn_bwd softmax statistics, per row from cuDNN 9.6 and per padded
# segment before - "te@cudnn9.5", on a TE release whose backward takes no dqkv_dtype), in
# float16, against the einsum reference on the same rounded values.

FORESTS = [TREE, [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2]],  # duplicates and a strict prefix
           [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 1], [0, 1, 5], [3, 3]]]
ACCELERATORS = ["flash_attn", "npu", "te", "te@cudnn9.5"]


def _install(monkeypatch, accelerator):
    """A fresh fake of an accelerator's kernel package for the current test (or example);
    the object recording its calls (``calls``, ``backward_calls``)."""
    from prefix_sharing.attention import npu_backend, te_backend
    from tests.attention import fake_kernels

    if accelerator == "npu":
        monkeypatch.setattr(npu_backend, "_COMPRESSED_MASKS", {})
        return fake_kernels.install_torch_npu(monkeypatch)
    if accelerator.startswith("te"):
        monkeypatch.setattr(te_backend, "_MODULES", {})
        variant = dict(version="2.13.0", cudnn=(9, 5, 0)) if "@" in accelerator else {}
        return fake_kernels.install_transformer_engine(monkeypatch, **variant).fused
    return fake_kernels.install_flash_attn(monkeypatch)


def _backend(accelerator):
    return accelerator.split("@")[0]


def _half_inputs(plan):
    token, position, w = projections()
    with torch.no_grad():
        q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    return [x.half().requires_grad_() for x in (q, k, v)]


def _reference_of_rows(plan, q, k, v, window):
    """The einsum reference per sequence on the flat rows' values (float64)."""
    per_seq = [plan.split(plan.restore(x.detach().double().requires_grad_(False)))
               for x in (q, k, v)]
    outs, lses = zip(*(einsum_reference(a, b, c, window, None) for a, b, c in zip(*per_seq)))
    return torch.cat(outs), torch.cat(lses)


def _gathered_lse(plan, q, k, v, window, backend):
    index = plan.kv_gather_index
    return varlen_attention(
        q, k.index_select(0, index), v.index_select(0, index), plan.cu_seqlens_q,
        plan.cu_seqlens_kv, plan.max_seqlen_q, plan.max_seqlen_kv, window=window,
        backend=backend, return_lse=True)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@settings(max_examples=20, deadline=None)
@given(seqs=forests(max_new_tokens=6), window=st.sampled_from([None, 1, 2, 40]))
def test_out_and_lse_of_the_accelerator_kernels_equal_the_einsum_reference(accelerator, seqs,
                                                                          window):
    """Random forests (empty tails, strict prefixes, duplicates), windows drawn; each segment
    over its gathered keys, the log-sum-exp read from the kernel's own outputs."""
    backend = _backend(accelerator)
    plan = build_plan(seqs, EVERY_PREFIX)
    q, k, v = _half_inputs(plan)
    with pytest.MonkeyPatch.context() as monkeypatch:  # a fresh fake per example
        kernel = _install(monkeypatch, accelerator)
        out, lse = _gathered_lse(plan, q, k, v, window, backend)
    want_out, want_lse = _reference_of_rows(plan, q, k, v, window)
    assert lse.dtype == torch.float32 and lse.shape == (HEADS, plan.num_tokens_flat)
    if backend == "flash_attn":
        assert kernel.calls[0]["return_attn_probs"]
    elif backend == "te":
        band = (-1, -1) if window is None else (window - 1, 0)
        assert {(call["attn_mask_type"], call["window_size"]) for call in kernel.calls} == {
            ("padding_causal_bottom_right", band)}
    else:
        assert {call["sparse_mode"] for call in kernel.calls} == {3 if window is None else 4}
    torch.testing.assert_close(plan.restore(out).double(), want_out, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(plan.restore(lse.t()).double(), want_lse, rtol=1e-5, atol=1e-5)


def test_the_npu_statistics_are_read_in_the_kernels_row_layout(monkeypatch):
    """Control: read as if token-major (``[T, N, 8]`` in memory order), softmax_max /
    softmax_sum give other rows' log-sum-exp wherever a call holds two segments or more."""
    from prefix_sharing.attention import npu_backend

    plan = build_plan(TREE, EVERY_PREFIX)
    q, k, v = _half_inputs(plan)
    _, want = _reference_of_rows(plan, q, k, v, None)
    _install(monkeypatch, "npu")
    errors = {}
    for layout in ("documented", "token_major"):
        if layout == "token_major":
            monkeypatch.setattr(npu_backend, "_softmax_rows", lambda ends_q, heads, device: (
                (torch.arange(ends_q[-1] * heads, device=device),) * 2))
        _, lse = _gathered_lse(plan, q, k, v, None, "npu")
        errors[layout] = float((plan.restore(lse.t()).double() - want).abs().max())
    assert errors["documented"] < 1e-5 and errors["token_major"] > 0.1, errors


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("seqs", FORESTS, ids=["tree", "duplicates", "mixed"])
def test_sources_on_the_accelerator_kernels_equal_the_einsum_reference(monkeypatch, accelerator,
                                                                       seqs):
    """prefix_attention over sources (the rule's choice wherever a segment reads a prefix;
    each part's backward at the merged state). flash-attn's rule: output and q/k/v gradients no further from the float64
    reference on the same values than 2x (gradients 3x) the gather on the same kernel, plus
    float16's rounding floor."""
    backend = _backend(accelerator)
    kernel = _install(monkeypatch, accelerator)
    plan = build_plan(seqs, EVERY_PREFIX)
    assert key_rows(plan, backend=backend).execution == (
        "sources" if plan.has_kv_gather else "in_place")
    ref_leaves = [x.detach().double().requires_grad_() for x in _half_inputs(plan)]
    per_seq = [plan.split(plan.restore(x)) for x in ref_leaves]
    want = torch.cat([einsum_reference(a, b, c, None, None)[0] for a, b, c in zip(*per_seq)])
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = (want.detach(), *torch.autograd.grad(want, ref_leaves, grad))
    errors = {}
    for execution in ("sources", "gather"):
        q, k, v = _half_inputs(plan)
        out = plan.restore(prefix_attention(q, k, v, plan, backend=backend,
                                            execution=execution))
        got = (out, *torch.autograd.grad(out, (q, k, v), grad.half()))
        errors[execution] = [float((a.detach().double() - b).abs().max() / b.abs().max())
                             for a, b in zip(got, ref)]
    floor = 2 * torch.finfo(torch.float16).eps
    for i, (mine, gather) in enumerate(zip(errors["sources"], errors["gather"])):
        assert mine <= (2 if i == 0 else 3) * gather + floor, (i, errors)
    if backend == "flash_attn":
        causal = {call["causal"] for call in kernel.backward_calls}
        assert causal == ({True, False} if plan.has_kv_gather else {True})  # the rectangles
        assert all(call["deterministic"] for call in kernel.backward_calls)
    elif backend == "te":  # the rectangles: "padding" (every key of a segment)
        masks = {call["attn_mask_type"] for call in kernel.backward_calls}
        assert masks == ({"padding_causal_bottom_right", "padding"} if plan.has_kv_gather
                         else {"padding_causal_bottom_right"})
        assert all(call["deterministic"] for call in kernel.backward_calls)
    else:  # the rectangles: sparse_mode 0 without a mask, forward and backward
        modes = {call["sparse_mode"] for call in kernel.backward_calls}
        assert modes == ({3, 0} if plan.has_kv_gather else {3})
        assert {call["sparse_mode"] for call in kernel.calls} == modes | {3}  # and the gather


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("window", [1, 2, 3, 40])
def test_windows_on_the_accelerator_kernels(monkeypatch, accelerator, window):
    """A window on a kernel with one band per call: over sources where no row bound is left
    in a node's call (the window reaches each kept row's node keys whole, or a single key),
    the trimmed gather where one is; either way the windowed attention of every row."""
    backend = _backend(accelerator)
    _install(monkeypatch, accelerator)
    executions = set()
    for seqs in FORESTS:
        plan = build_plan(seqs, EVERY_PREFIX)
        q, k, v = (x.detach() for x in _half_inputs(plan))
        executions.add(key_rows(plan, window=window, backend=backend).execution)
        out = prefix_attention(q, k, v, plan, window=window, backend=backend)
        want, _ = _reference_of_rows(plan, q, k, v, window)
        torch.testing.assert_close(plan.restore(out).double(), want, rtol=2e-3, atol=2e-3)
    # the duplicates' plan reads no prefix (in place); a window of 3 leaves row bounds in the
    # tree's nodes (gathered), not in the mixed forest's
    assert executions - {"in_place"} == ({"sources", "gather"} if window == 3 else {"sources"})


# TE computes in half precision only: float16 q, k, v against the float64 reference on the
# unrounded values
@pytest.mark.parametrize("accelerator, dtype, tol", [("npu", torch.float32, 1e-5),
                                                      ("te", torch.float16, 1e-2)])
def test_sinks_are_merged_over_sources_and_refused_on_the_kernel_alone(monkeypatch, accelerator,
                                                                       dtype, tol):
    """npu_fusion_attention has no sink term, nor does TE's kernel as called here: over
    sources the merge adds the sink as one more source (served); a plan whose segments read
    no prefix runs the kernel alone and is refused by name."""
    _install(monkeypatch, accelerator)
    sinks = torch.randn(HEADS, dtype=torch.float64)
    for seqs, served in ((TREE, True), ([[1, 2, 3], [4, 5]], False)):
        plan = build_plan(seqs, EVERY_PREFIX)
        token, position, w = projections()
        with torch.no_grad():
            q, k, v = (x.to(dtype) for x in qkv(token, position, w, plan.input_ids,
                                                  plan.position_ids))
            if not served:
                with pytest.raises(UnsupportedSetup, match=r"\[kernels\.sinks\]"):
                    prefix_attention(q, k, v, plan, backend=accelerator, sinks=sinks.float())
                continue
            out = prefix_attention(q, k, v, plan, backend=accelerator, sinks=sinks.float())
            want, _ = plain(seqs, None, sinks)
        assert _worst([plan.restore(out).double()], [want]) < tol


# ------------------------------------------------- a backend without a with-lse pair
# FlexAttention has no backward at a given output and log-sum-exp: the rule runs it as one
# masked call (test_flex_backend.py), never over sources, and asking it for the log-sum-exp of
# a varlen call is refused by name.


def test_a_backend_without_a_with_lse_pair_is_refused_the_log_sum_exp():
    plan = build_plan(TREE, EVERY_PREFIX)
    assert key_rows(plan, backend="flex").execution == "tree_mask"
    token, position, w = projections()
    with torch.no_grad():
        q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    with pytest.raises(UnsupportedSetup, match=r"\[kernels\.lse\]"):
        prefix_attention(q, k, v, plan, backend="flex", execution="sources")
    with pytest.raises(UnsupportedSetup, match=r"\[kernels\.lse\]"):
        varlen_attention(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_q, plan.max_seqlen_q,
                         plan.max_seqlen_q, backend="flex", return_lse=True)


# ------------------------------------------------- a cross-micro-batch store's K/V
# A suffix micro-batch's plan addresses its stack of stored blocks in front of its own rows
# (external_rows); the store hands their K/V over as they are (prefix_sharing.prefix_kv) and
# prefix_attention reads each block as a key source of its own.

HISTORY = [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 5, 1, 3, 4], [1, 2, 3, 4, 5, 2, 2],
           [1, 2, 3, 4, 5, 3]]


def _suffixes_and_stored():
    """The suffix micro-batches of a group whose 5-token history is cut into blocks (budget
    4), each with its stored blocks' K/V (float64 leaves, as the store's)."""
    from prefix_sharing.cross_micro_batch import plan_group

    schedule = plan_group([torch.tensor(s) for s in HISTORY], 4, EVERY_PREFIX)
    token, position, w = projections()
    stored = []
    with torch.no_grad():
        for block in schedule.blocks:
            _, k, v = qkv(token, position, w, block.ids, torch.arange(block.start, block.end))
            stored.append((k, v))
    return [(s.plan, [stored[r] for r in s.reads]) for s in schedule.suffixes]


class _RowCopies(_KeyCopies):
    """:class:`_KeyCopies` of the ops that copy K/V rows together (``cat``, ``index_select``;
    the torch kernel's own intermediates may take K/V's shape on these small segments)."""

    OPS = {torch.ops.aten.cat.default, torch.ops.aten.index_select.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.OPS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _store_step(plan, stored, execution, window=None):
    """prefix_attention of a suffix over its stored blocks: its output, the gradients of
    its q, K/V and every stored K/V, and the K/V rows the forward holds."""
    token, position, w = projections()
    with torch.no_grad():
        own = qkv(token, position, w, plan.input_ids, plan.position_ids)
    q, k, v = [x.clone().requires_grad_() for x in own]
    leaves = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in stored]
    with _RowCopies() as copies:
        out = prefix_attention(q, k, v, plan, execution=execution, stored=leaves,
                               window=window)
    held = 2 * (k.size(0) + sum(a.size(0) for a, _ in leaves)) + copies.rows
    inputs = [q, k, v, *(t for pair in leaves for t in pair)]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return (out, *torch.autograd.grad(out, inputs, grad)), held


def test_a_stored_prefix_is_a_key_source_read_in_place():
    """Every suffix micro-batch (one and two stored blocks) reads its blocks' K/V in place:
    the forward holds its own and the stored K/V rows and copies none (no ``cat(stored,
    own)``, no gather), with the output and every gradient of the concatenate+gather path
    (the control, which copies both). The same under sliding windows (2: some rows reach
    no stored key, or only a block's last ones; 40: every block whole)."""
    cases = _suffixes_and_stored()
    assert {len(stored) for _, stored in cases} >= {2}  # a stack of blocks, not one
    for plan, stored in cases:
        ext, own = plan.external_rows, plan.num_tokens_flat
        for window in (None, 2, 40):
            rows = key_rows(plan, window=window)
            assert (rows.execution, rows.kv_rows, rows.stored_rows) == ("sources", own, ext)
            got, held = _store_step(plan, stored, "auto", window)
            want, held_gather = _store_step(plan, stored, "gather", window)
            assert held == 2 * (own + ext)  # K and V: the inputs, nothing copied
            if window is None:
                assert held_gather == 2 * (own + ext + ext + own + plan.cu_seqlens_kv_host[-1])
            for a, b in zip(got, want):
                a, b = a.detach(), b.detach()
                assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max())
