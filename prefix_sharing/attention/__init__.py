"""Attention over the flat layout with K/V injection, and the kernels that compute it.

Every backend implements one signature, that of ``flash_attn_varlen_func(causal=True)``:
``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)``, plus
the keywords ``window`` (a sliding window, bottom-right band) and ``sinks`` (a learned logit per
head in the softmax denominator), and optional keywords (host boundaries, a per-layer kernel
cache) that only some kernels read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..plan import SharingPlan
from .backends import get_backend, resolve_backend
from .torch_backend import varlen_attention_torch
from .window import windowed_keys

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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
    kernel_cache: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Causal (bottom-right) varlen attention on the chosen kernel.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale: as in
            :func:`varlen_attention_torch`.
        window: keys each query sees, itself included (``None``: all earlier keys).
        sinks: ``(nheads,)`` sink logits (``None``: vanilla softmax); the torch kernel only
            (the others refuse them).
        backend: ``"auto"``, ``"torch"``, ``"flash_attn"``, ``"te"``, ``"npu"``; ``"auto"``
            chooses by q's device and dtype (see :func:`~.backends.resolve_backend`).
        cu_seqlens_q_host, cu_seqlens_k_host: the same boundaries as host ints, for the kernels
            that need them on the host (torch, npu); computed from the tensors when omitted,
            which reads the device.
        kernel_cache: where a stateful kernel keeps its state between calls (Transformer
            Engine's attention module): pass one dict per layer. A process-wide cache when
            omitted.
    """
    fn = get_backend(resolve_backend(backend, q.device, q.dtype))
    return fn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        window=window, sinks=sinks, cu_seqlens_q_host=cu_seqlens_q_host,
        cu_seqlens_k_host=cu_seqlens_k_host,
        kernel_cache=kernel_cache,
    )


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SharingPlan,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
    kernel_cache: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Causal self-attention of a plan's flat layout, reusers reading their provider's K/V.

    Args:
        q: ``(T_flat, nheads, headdim)`` queries of the computed tokens (positions applied).
        k, v: ``(T_flat, nheads_k, headdim)`` keys and values of the same tokens.
        plan: the micro-batch's :class:`SharingPlan`, on the tensors' device.
        softmax_scale: defaults to ``headdim ** -0.5``.
        window: a sliding window of this many keys, on logical positions (``None``: full
            causal). A reuser's gather is trimmed to the prefix keys its window reaches
            (:func:`~.window.windowed_keys`).
        sinks: ``(nheads,)`` per-head sink logits (``None``: vanilla softmax).
        backend: the kernel, as in :func:`varlen_attention`.
        kernel_cache: as in :func:`varlen_attention` (one dict per layer).

    Returns:
        ``(T_flat, nheads, headdim)``: for every computed token, attention over all earlier
        tokens of its own sequence - exactly what the plain forward gives that token. No
        device-to-host read: the host boundaries come from the plan.
    """
    if q.size(0) != plan.num_tokens_flat:
        raise ValueError(
            f"q has {q.size(0)} tokens but the plan lays out {plan.num_tokens_flat}: "
            "was the plan built from this micro-batch?"
        )
    # Keys in place: every segment's keys are its own rows of k/v (no segment reads a prefix,
    # and k/v hold exactly the flat rows - not a cross-micro-batch prefix placed before them).
    in_place = not plan.has_kv_gather and k.size(0) == plan.num_tokens_flat
    keys = windowed_keys(plan, window) if window is not None and not in_place else plan
    if not in_place:
        # K/V injection: each segment's keys are its provider's prefix rows plus its own tail.
        # index_select's backward scatter-adds, so every reuser's gradient reaches the prefix.
        k = k.index_select(0, keys.kv_gather_index)
        v = v.index_select(0, keys.kv_gather_index)
    return varlen_attention(
        q, k, v, plan.cu_seqlens_q, keys.cu_seqlens_kv, plan.max_seqlen_q, keys.max_seqlen_kv,
        softmax_scale, window=window, sinks=sinks, backend=backend,
        cu_seqlens_q_host=plan.cu_seqlens_q_host, cu_seqlens_k_host=keys.cu_seqlens_kv_host,
        kernel_cache=kernel_cache,
    )
