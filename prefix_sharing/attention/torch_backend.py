"""Variable-length attention in plain torch: the CPU backend and the reference for the kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["varlen_attention_torch"]


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
    bounds_q = cu_seqlens_q.tolist() if cu_seqlens_q_host is None else cu_seqlens_q_host
    bounds_k = cu_seqlens_k.tolist() if cu_seqlens_k_host is None else cu_seqlens_k_host
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
