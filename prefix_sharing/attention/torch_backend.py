"""Variable-length attention in plain torch: the CPU backend and the reference for the kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .backends import host_boundaries

__all__ = ["attention_lse_backward_torch", "attention_lse_torch", "varlen_attention_torch"]


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
    kernel_cache: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Causal attention of packed query segments over packed key/value segments.

    Segment ``i`` has queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` and keys/values
    ``k/v[cu_seqlens_k[i]:cu_seqlens_k[i+1]]``. The queries are the *last* ``s`` positions of the
    ``L`` keys, so the causal mask is aligned bottom-right, as in
    ``flash_attn_varlen_func(causal=True)``; e.g. ``s = 2``, ``L = 5``::

        1 1 1 1 0
        1 1 1 1 1

    A ``window`` of ``w`` keys narrows that to the band of the last ``w`` (logical positions
    ``p - w + 1 .. p``), still aligned bottom-right; ``w = 3`` above::

        0 1 1 1 0
        0 0 1 1 1

    ``sinks`` add one learned logit per head to every query's softmax denominator (gpt-oss's
    attention sinks; megatron's ``softmax_type="learnable"``, or zeros for ``"off-by-one"``):
    ``p_j = exp(x_j) / (exp(sink_h) + sum_k exp(x_k))``. The sink has no value: the weights
    simply sum to less than one.

    Args:
        q: ``(total_q, nheads, headdim)``.
        k, v: ``(total_k, nheads_k, headdim)``; ``nheads`` must be a multiple of ``nheads_k``
            (grouped-query attention: query head ``h`` reads key head ``h // (nheads // nheads_k)``).
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` int32 boundaries, same segment count;
            each segment needs ``0 < s <= L``.
        max_seqlen_q, max_seqlen_k: longest segment lengths (kept for the kernels' signature;
            unused here).
        softmax_scale: defaults to ``headdim ** -0.5``.
        window: keys each query sees, itself included, counted back from its own position
            (``None``: all earlier keys). A segment's keys are contiguous positions ending at
            its last query, so a gather trimmed at the front changes nothing.
        sinks: ``(nheads,)`` sink logits (``None``: the vanilla softmax); differentiable.
        cu_seqlens_q_host, cu_seqlens_k_host: the same boundaries as host ints. The segments are
            sliced on the host, so without them the tensors are read back once per call.
        kernel_cache: unused (this kernel keeps no state).

    Returns:
        ``(total_q, nheads, headdim)``, differentiable with respect to ``q``, ``k`` and ``v``.
    """
    del max_seqlen_q, max_seqlen_k, kernel_cache
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one key (itself); got {window}")
    if sinks is not None and sinks.shape != (q.size(1),):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q.size(1)},); "
                         f"got {tuple(sinks.shape)}")
    gqa = q.size(1) != k.size(1)
    out = []
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        s, L = qe - qs, ke - ks
        # [s, h, d] -> [h, s, d]: one segment is one SDPA "batch" of heads.
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        if sinks is not None:
            oi = _attend_with_sinks(qi, ki, vi, _band(s, L, window, q.device), softmax_scale, sinks)
        elif s == L and window is None:
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=softmax_scale, enable_gqa=gqa
            )
        else:
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=_band(s, L, window, q.device), scale=softmax_scale,
                enable_gqa=gqa,
            )
        out.append(oi.transpose(0, 1))
    return torch.cat(out) if len(out) > 1 else out[0].contiguous()


def _band(s: int, L: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``(s, L)`` bool, True where query ``i`` (logical ``L - s + i``) may read key ``j``."""
    mask = torch.ones(s, L, dtype=torch.bool, device=device).tril_(L - s)
    if window is not None:
        mask.triu_(L - s - window + 1)
    return mask


def _attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    softmax_scale: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention of one segment with a sink logit per head: ``q [h, s, d]``, ``k/v [hk, L, d]``.

    SDPA has no sink term, so the scores are written out; the softmax runs in float32 at
    least (as the fused kernels accumulate), over the keys plus one sink column that is
    dropped afterwards.
    """
    group = q.size(0) // k.size(0)
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("hqd,hkd->hqk", q.to(compute), k.to(compute)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(compute).view(-1, 1, 1).expand(-1, scores.size(1), 1)  # [h, s, 1]
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,hkd->hqd", probs, v.to(compute)).to(q.dtype)


# ------------------------------------------------------------------ with the log-sum-exp
# aten's CPU flash kernel returns the log-sum-exp and its backward takes the output and the
# log-sum-exp it is given: the contract the merge over key sources needs (each part's backward
# is run with the *merged* output and log-sum-exp, as ring attention does). Its mask is
# additive in q's dtype, and it takes one head count and one head dim for q, k and v. GQA runs
# as a batch: the ``group`` query heads of each key head are the kernel's batch dimension over
# the same key heads, expanded along it with stride 0 (no copy of K/V; the kernel reads
# strides), and their key gradients summed in float32. A smaller value head dim (multi-latent
# attention) is zero-padded to the query's, the output trimmed back (the padded channels are
# sums of zeros; in the backward their output gradient is zero, so they change nothing).


def attention_lse_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    first_key: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention returning ``(out, lse)``, without autograd (the caller's Function
    runs :func:`attention_lse_backward_torch`).

    Segments as in :func:`varlen_attention_torch`, with three differences: ``causal=False``
    lets every query of a segment read every key of it (the dense rectangle of a shared
    node's readers over its keys); with it, ``first_key`` ``(total_q,)`` int64 names for each
    query row the first key of its segment it reads (a sliding window over a shared node:
    its readers stack in one segment at different distances from it, so each row has its own
    bound; every row reads at least its segment's last key); and a segment may hold no query
    (its keys are read by nobody: the rows between shared nodes, which the kernel is told
    about so that K/V stay in place). ``window``: causal calls only, as there.

    Returns:
        out: ``(total_q, nheads, headdim_v)`` in q's dtype.
        lse: ``(nheads, total_q)``, the natural log of each query row's softmax denominator
            ``log sum_j exp(scale * q . k_j)`` over the keys it reads, float32 (float64 for
            float64 inputs) - flash-attn's ``softmax_lse`` layout and meaning.
    """
    del max_seqlen_q, max_seqlen_k
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(q.size(0), q.size(1), v.size(-1))
    lse = torch.empty(q.size(1), q.size(0), dtype=lse_dtype, device=q.device)
    heads_k = k.size(1)
    for qs, qe, ks, ke in _segments(bounds_q, bounds_k):
        qi, ki, vi, mask, is_causal = _segment_inputs(q, k, v, qs, qe, ks, ke, causal, window,
                                                      first_key)
        # [group, hk, s, d] each; the kernel's lse is [group, hk, s]
        oi, li = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qi, ki, vi, 0.0, is_causal, attn_mask=mask, scale=softmax_scale)
        _to_kernel(out[qs:qe], heads_k).copy_(oi[..., : v.size(-1)])
        lse[:, qs:qe].view(heads_k, -1, qe - qs).transpose(0, 1).copy_(li)
    return out, lse


def attention_lse_backward_torch(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    first_key: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_lse_torch`, given the output and log-sum-exp to
    differentiate at. With a merged ``out`` and ``lse`` (attention over several key sources),
    ``exp(scale * q . k - lse)`` is each key's weight in the *merged* softmax and
    ``rowsum(dout * out)`` the merged one, so each part's gradients are exactly its share of
    the whole attention's. Keys of segments without queries get zero gradients; dk and dv are
    summed over the query heads of a group in float32 and written once."""
    del max_seqlen_q, max_seqlen_k
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    heads_k = k.size(1)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    kernel_lse = torch.float64 if q.dtype == torch.float64 else torch.float32
    for qs, qe, ks, ke in _segments(bounds_q, bounds_k):
        qi, ki, vi, mask, is_causal = _segment_inputs(q, k, v, qs, qe, ks, ke, causal, window,
                                                      first_key)
        lse_i = lse[:, qs:qe].to(kernel_lse).view(heads_k, -1, qe - qs).transpose(0, 1)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _to_kernel(_pad_value(dout[qs:qe], q.size(-1)), heads_k), qi, ki, vi,
            _to_kernel(_pad_value(out[qs:qe], q.size(-1)), heads_k), lse_i, 0.0, is_causal,
            attn_mask=mask, scale=softmax_scale)
        _to_kernel(dq[qs:qe], heads_k).copy_(gq)
        # [group, hk, L, d] -> [L, hk, d]: the query heads of one key head summed in fp32
        dk[ks:ke] = _sum_groups(gk).to(k.dtype)
        dv[ks:ke] = _sum_groups(gv[..., : v.size(-1)]).to(v.dtype)
    return dq, dk, dv


def _segments(bounds_q: Sequence[int], bounds_k: Sequence[int]):
    """``(qs, qe, ks, ke)`` of every segment with at least one query (aten's CPU kernel
    takes no empty query block)."""
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        if qe > qs:
            yield qs, qe, ks, ke


def _segment_inputs(q, k, v, qs, qe, ks, ke, causal, window, first_key=None):
    """One segment as the CPU kernel takes it: q as ``[group, hk, s, d]`` (a view), K/V as
    ``[group, hk, L, d]`` expanded along the batch dimension (stride 0, no copy), and the mask
    (None where ``is_causal`` or no mask says it all)."""
    s, L = qe - qs, ke - ks
    heads_k, group = k.size(1), q.size(1) // k.size(1)
    qi = _to_kernel(q[qs:qe], heads_k)
    ki = k[ks:ke].transpose(0, 1).unsqueeze(0).expand(group, -1, -1, -1)
    vi = _pad_value(v[ks:ke], q.size(-1)).transpose(0, 1).unsqueeze(0).expand(group, -1, -1, -1)
    if (first_key if causal else window) is not None:
        raise ValueError("a causal call's keys are bounded by a window, a non-causal call's by "
                         f"first_key; got causal={causal} with the other")
    if not causal and first_key is None:
        return qi, ki, vi, None, False
    if causal and s == L and window is None:
        return qi, ki, vi, None, True
    if causal:
        allowed = _band(s, L, window, q.device)
    else:  # each row's own first key (a window over a shared node)
        allowed = torch.arange(L, device=q.device) >= first_key[qs:qe, None]
    mask = torch.zeros(s, L, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return qi, ki, vi, mask, False


def _to_kernel(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """``[s, h, d] -> [group, hk, s, d]``, a view (written through where the kernel's results
    are copied in): query head ``h = j * group + g`` reads key head ``j``, as grouped-query
    attention pairs them."""
    s, h, d = x.shape
    return x.view(s, heads_k, h // heads_k, d).permute(2, 1, 0, 3)


def _pad_value(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[n, h, dv] -> [n, h, head_dim]`` with zeros (``dv <= head_dim``)."""
    return x if x.size(-1) == head_dim else F.pad(x, (0, head_dim - x.size(-1)))


def _sum_groups(grad: torch.Tensor) -> torch.Tensor:
    """``[group, hk, L, d]`` per query head -> ``[L, hk, d]`` per key head (summed in fp32)."""
    summed = grad.float() if grad.dtype != torch.float64 else grad
    return summed.sum(0).transpose(0, 1)
