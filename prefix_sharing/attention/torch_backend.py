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

    Args:
        q: ``(total_q, nheads, headdim)``.
        k, v: ``(total_k, nheads_k, headdim)``; ``nheads`` must be a multiple of ``nheads_k``
            (grouped-query attention: query head ``h`` reads key head ``h // (nheads // nheads_k)``).
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` int32 boundaries, same segment count;
            each segment needs ``0 < s <= L``.
        max_seqlen_q, max_seqlen_k: longest segment lengths (kept for the kernels' signature;
            unused here).
        softmax_scale: defaults to ``headdim ** -0.5``.
        cu_seqlens_q_host, cu_seqlens_k_host: the same boundaries as host ints. The segments are
            sliced on the host, so without them the tensors are read back once per call.
        kernel_cache: unused (this kernel keeps no state).

    Returns:
        ``(total_q, nheads, headdim)``, differentiable with respect to ``q``, ``k`` and ``v``.
    """
    del max_seqlen_q, max_seqlen_k, kernel_cache
    bounds_q = cu_seqlens_q.tolist() if cu_seqlens_q_host is None else cu_seqlens_q_host
    bounds_k = cu_seqlens_k.tolist() if cu_seqlens_k_host is None else cu_seqlens_k_host
    gqa = q.size(1) != k.size(1)
    out = []
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        s, L = qe - qs, ke - ks
        # [s, h, d] -> [h, s, d]: one segment is one SDPA "batch" of heads.
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        if s == L:
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=softmax_scale, enable_gqa=gqa
            )
        else:
            mask = torch.ones(s, L, dtype=torch.bool, device=q.device).tril_(L - s)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa
            )
        out.append(oi.transpose(0, 1))
    return torch.cat(out) if len(out) > 1 else out[0].contiguous()
