"""Attention over the flat layout with K/V injection, and the kernels that compute it.

Every backend implements one signature, that of ``flash_attn_varlen_func(causal=True)``:
``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)``, plus
the keywords ``window`` (a sliding window, bottom-right band) and ``sinks`` (a learned logit per
head in the softmax denominator), and optional keywords (host boundaries, a per-layer kernel
cache) that only some kernels read. Where a backend has a with-lse pair (``LSE_KERNELS``),
``varlen_attention(return_lse=True)`` also returns the log-sum-exp, and ``prefix_attention``
attends over key sources in place, merged by it (:mod:`.sources`, :mod:`.merge`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..plan import SharingPlan
from ..refusals import refuse
from .backends import (ROW_KEY_BOUNDS, get_backend, get_lse_kernel, host_boundaries,
                       resolve_backend)
from .flex_backend import tree_attention_flex
from .merge import KeyPart, SourceLayout, attention_over_sources
from .sources import EXECUTIONS, choose_execution, runnable_layout, source_layout
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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal (bottom-right) varlen attention on the chosen kernel.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale: as in
            :func:`varlen_attention_torch`.
        window: keys each query sees, itself included (``None``: all earlier keys).
        sinks: ``(nheads,)`` sink logits (``None``: vanilla softmax); the torch kernel only
            (the others refuse them).
        backend: ``"auto"``, ``"torch"``, ``"flash_attn"``, ``"te"``, ``"npu"``, ``"flex"``;
            ``"auto"`` chooses by q's device and dtype (see :func:`~.backends.resolve_backend`).
        cu_seqlens_q_host, cu_seqlens_k_host: the same boundaries as host ints, for the kernels
            that need them on the host (torch, npu); computed from the tensors when omitted,
            which reads the device.
        kernel_cache: where a stateful kernel keeps its state between calls (Transformer
            Engine's attention module): pass one dict per layer. A process-wide cache when
            omitted.
        return_lse: also return the log-sum-exp: ``(nheads, total_q)`` float32 (float64 for
            float64 inputs), the natural log of each query row's softmax denominator
            ``log(sum_j exp(scale * q . k_j) [+ exp(sink)])``, as flash-attn's
            ``softmax_lse``; it carries no gradient. Backends with a with-lse pair only.

    Returns:
        ``(total_q, nheads, headdim_v)``, or ``(out, lse)`` with ``return_lse``.
    """
    name = resolve_backend(backend, q.device, q.dtype)
    if return_lse:
        kernel = get_lse_kernel(name)
        if kernel is None:
            raise refuse("kernels.lse", f"backend {name!r}")
        # a standalone call: its boundaries read once here (a planned layer passes the plan's)
        host_q = tuple(host_boundaries(cu_seqlens_q, cu_seqlens_q_host))
        host_k = tuple(host_boundaries(cu_seqlens_k, cu_seqlens_k_host))
        part = KeyPart(None, cu_seqlens_q, cu_seqlens_k, host_q, host_k,
                       max_seqlen_q, max_seqlen_k, causal=True, window=window)
        return attention_over_sources(q, k, v, SourceLayout((part,)), kernel, softmax_scale,
                                      sinks=sinks)
    fn = get_backend(name)
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
    execution: str = "auto",
    stored: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> torch.Tensor:
    """Causal self-attention of a plan's flat layout, reusers reading their provider's K/V.

    Args:
        q: ``(T_flat, nheads, headdim)`` queries of the computed tokens (positions applied).
        k, v: ``(T_flat, nheads_k, headdim)`` keys and values of the same tokens.
        plan: the micro-batch's :class:`SharingPlan`, on the tensors' device.
        softmax_scale: defaults to ``headdim ** -0.5``.
        window: a sliding window of this many keys, on logical positions (``None``: full
            causal). A reuser's gather is trimmed to the prefix keys its window reaches
            (:func:`~.window.windowed_keys`); over sources each reader's rows read a node
            from their first key in the window on.
        sinks: ``(nheads,)`` per-head sink logits (``None``: vanilla softmax).
        backend: the kernel, as in :func:`varlen_attention`.
        kernel_cache: as in :func:`varlen_attention` (one dict per layer).
        execution: ``"auto"`` (the rule of :mod:`.sources`, chosen once per plan on the
            host), or ``"sources"`` / ``"tree_mask"`` / ``"gather"`` / ``"in_place"`` to force
            one (a forced one the plan or backend cannot run raises).
        stored: the K/V of the plan's ``external_rows`` (a cross-micro-batch store's blocks,
            ``(k_i, v_i)`` in row order, adding up to ``external_rows``): key sources read in
            place under ``"sources"``; concatenated in front of ``k``, ``v`` under
            ``"gather"``, the execution chosen on purpose where the sources cannot run (a
            backend without a with-lse pair: FlexAttention; a sliding window that cuts a node
            on flash-attn, TE or torch_npu; stored rows
            the plan does not lay out, read through ``kv_gather_index`` as before). Gradients
            reach them either way.

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
    stored_rows = tuple(key.size(0) for key, _ in stored)
    name = resolve_backend(backend, q.device, q.dtype)
    chosen = choose_execution(plan, k.size(0), window, name, stored_rows)
    if execution != "auto" and execution != chosen:
        _check_forced(execution, plan, k, window, name, stored_rows)
        chosen = execution
    if chosen == "sources":
        # Own segments causally, shared nodes and stored blocks as dense rectangles, K/V in
        # place, merged by the log-sum-exp: no per-reader copy of K/V, no scatter in the
        # backward, no concatenation of a stored prefix.
        layout = source_layout(plan, stored_rows, window=window)
        out, _ = attention_over_sources(q, k, v, layout, get_lse_kernel(name), softmax_scale,
                                        sinks=sinks, stored=stored)
        return out
    if chosen == "tree_mask":  # one FlexAttention call over the flat rows, K/V in place
        return tree_attention_flex(q, k, v, plan, softmax_scale, window=window, sinks=sinks)
    if stored:  # the gather addresses cat(stored rows, flat rows)
        k = torch.cat([*(key for key, _ in stored), k])
        v = torch.cat([*(value for _, value in stored), v])
    keys = plan
    if chosen == "gather":
        # K/V injection: each segment's keys are its provider's prefix rows plus its own tail.
        # index_select's backward scatter-adds, so every reuser's gradient reaches the prefix.
        keys = plan if window is None else windowed_keys(plan, window)
        k = k.index_select(0, keys.kv_gather_index)
        v = v.index_select(0, keys.kv_gather_index)
    return varlen_attention(
        q, k, v, plan.cu_seqlens_q, keys.cu_seqlens_kv, plan.max_seqlen_q, keys.max_seqlen_kv,
        softmax_scale, window=window, sinks=sinks, backend=name,
        cu_seqlens_q_host=plan.cu_seqlens_q_host, cu_seqlens_k_host=keys.cu_seqlens_kv_host,
        kernel_cache=kernel_cache,
    )


def _check_forced(execution: str, plan: SharingPlan, k: torch.Tensor, window: int | None,
                  backend: str, stored_rows: tuple[int, ...]) -> None:
    """Raises where a forced execution cannot compute this plan's attention."""
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be 'auto' or one of {EXECUTIONS}; got {execution!r}")
    if execution == "in_place" and (plan.has_kv_gather or k.size(0) != plan.num_tokens_flat):
        raise ValueError("execution='in_place': some segment reads keys beyond its own rows")
    if execution == "tree_mask" and (backend != "flex" or source_layout(plan) is None
                                     or k.size(0) != plan.num_tokens_flat):
        raise ValueError("execution='tree_mask' runs on backend='flex' over K/V of a "
                         "planner-built plan's flat rows (no stored rows)")
    if execution == "sources" and get_lse_kernel(backend) is None:
        raise refuse("kernels.lse", f"backend {backend!r}, execution='sources'")
    if execution == "sources" and (
        k.size(0) != plan.num_tokens_flat
        or runnable_layout(plan, backend, stored_rows, window=window) is None
    ):
        raise ValueError(
            "execution='sources' needs K/V of the plan's flat rows, a planner-built plan and, "
            f"where a window cuts a shared node, a kernel in {sorted(ROW_KEY_BOUNDS)}")
