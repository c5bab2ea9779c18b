"""Attention over the flat layout with K/V injection, and the kernels that compute it.

Every backend implements one signature, that of ``flash_attn_varlen_func(causal=True)``:
``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)``.
"""

from __future__ import annotations

import torch

from ..plan import SharingPlan
from .backends import get_backend, resolve_backend
from .torch_backend import varlen_attention_torch

__all__ = ["prefix_attention", "varlen_attention", "varlen_attention_torch"]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal (bottom-right) varlen attention on the chosen kernel; see ``varlen_attention_torch``
    for the arguments. ``backend``: ``"auto"``, ``"torch"``, ``"flash_attn"``, ``"te"``, ``"npu"``.
    """
    fn = get_backend(resolve_backend(backend, q.device))
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SharingPlan,
    *,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal self-attention of a plan's flat layout, reusers reading their provider's K/V.

    Args:
        q: ``(T_flat, nheads, headdim)`` queries of the computed tokens (positions applied).
        k, v: ``(T_flat, nheads_k, headdim)`` keys and values of the same tokens.
        plan: the micro-batch's :class:`SharingPlan`, on the tensors' device.
        softmax_scale: defaults to ``headdim ** -0.5``.
        backend: the kernel, as in :func:`varlen_attention`.

    Returns:
        ``(T_flat, nheads, headdim)``: for every computed token, attention over all earlier
        tokens of its own sequence - exactly what the plain forward gives that token.
    """
    if q.size(0) != plan.num_tokens_flat:
        raise ValueError(
            f"q has {q.size(0)} tokens but the plan lays out {plan.num_tokens_flat}: "
            "was the plan built from this micro-batch?"
        )
    if plan.has_sharing:
        # K/V injection: each segment's keys are its provider's prefix rows plus its own tail.
        # index_select's backward scatter-adds, so every reuser's gradient reaches the prefix.
        k = k.index_select(0, plan.kv_gather_index)
        v = v.index_select(0, plan.kv_gather_index)
    return varlen_attention(
        q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_kv, plan.max_seqlen_q, plan.max_seqlen_kv,
        softmax_scale, backend=backend,
    )
