"""FlexAttention (``torch.nn.attention.flex_attention``): every key source in one call, by a mask.

FlexAttention computes attention under a mask given as a function of (query row, key row) and
skips the key blocks the mask leaves empty (a :class:`~torch.nn.attention.flex_attention.
BlockMask`, built once per layout). Over a plan's flat rows - K/V in place, the computed rows
only - the plan's tree is such a mask (:func:`tree_attention_flex`): query row ``r`` reads

- the rows of its own segment from ``key_first[r]`` to itself (bottom-right causal; a window
  of ``w`` keys moves ``key_first`` up to ``r - w + 1``, its own rows being consecutive
  positions), and
- the rows its segment reads as its prefix (``reads[group[r], j]``: the plan's prefix runs, a
  tree's ancestors), those at logical positions ``>= read_from[r]`` (``position[r] - w + 1``
  under a window, every one without).

One kernel call per layer, no per-reader copy of K/V, no merge: the FlexAttention backward (its
Triton kernel on CUDA) accumulates each shared row's dK/dV over its readers. A plain varlen
call (:func:`varlen_attention_flex`) is the same mask without reads: each query row reads the
key rows ``key_first[r] .. key_last[r]`` of its segment, aligned bottom-right.

On CUDA the kernel is ``torch.compile``'d (eager FlexAttention materializes every score); on
CPU it runs eagerly and forward only (torch 2.13 and 2.15 have no CPU backward). The block mask
is built once per micro-batch by torch's ``create_block_mask``, which evaluates the mask on
every (query, key) pair: ``T x T`` booleans for a moment, on the tensors' device. Not run on a
GPU by this project's CI: its CPU tests check the masks against the plan and the outputs, and
the gradients against a CPU implementation of FlexAttention's documented semantics.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..memo import derived
from ..plan import SharingPlan
from ..refusals import refuse
from .backends import host_boundaries

__all__ = ["FlexMask", "flex_mask", "flex_rows_attention", "plan_flex_mask",
           "tree_attention_flex", "varlen_attention_flex"]

# FlexAttention's block: the mask is evaluated per (query block, key block) to skip empty ones
BLOCK_SIZE = 128


class FlexMask:
    """Which key rows each query row reads, as FlexAttention's ``mask_mod`` and its block mask.

    Args:
        key_first, key_last: ``(Tq,)`` int64: the contiguous key rows each query row reads (its
            own segment's band).
        num_keys: ``Tk``.
        reads: ``(G, Tk)`` bool: further key rows each read group reads (a segment's prefix
            rows), or ``None``.
        group: ``(Tq,)`` int64, each query row's read group (with ``reads``).
        key_position: ``(Tk,)`` int64, each key row's logical position (with ``reads``).
        read_from: ``(Tq,)`` int64, the first logical position of a read key each query row
            sees (with ``reads``).
        block_size: FlexAttention's block, in rows.

    Attributes:
        mask_mod: FlexAttention's ``mask_mod`` over those tensors (it holds them).
        block_mask: the ``BlockMask`` over ``Tq x Tk`` rows, built on the tensors' device.
    """

    def __init__(self, key_first: torch.Tensor, key_last: torch.Tensor, num_keys: int, *,
                 reads: torch.Tensor | None = None, group: torch.Tensor | None = None,
                 key_position: torch.Tensor | None = None,
                 read_from: torch.Tensor | None = None, block_size: int = BLOCK_SIZE):
        from torch.nn.attention.flex_attention import create_block_mask

        self.mask_mod = _mask_mod(key_first, key_last, reads, group, key_position, read_from)
        self.block_mask = create_block_mask(
            self.mask_mod, None, None, key_first.size(0), num_keys, device=key_first.device,
            BLOCK_SIZE=block_size)


def _mask_mod(key_first, key_last, reads, group, key_position, read_from):
    """FlexAttention's ``mask_mod`` over :class:`FlexMask`'s arguments: True where query row
    ``q_idx`` reads key row ``kv_idx`` (lookups only, no data-dependent control flow, so it
    compiles into the kernel)."""

    def own(batch, head, q_idx, kv_idx):
        return (kv_idx >= key_first[q_idx]) & (kv_idx <= key_last[q_idx])

    def own_or_read(batch, head, q_idx, kv_idx):
        read = reads[group[q_idx], kv_idx] & (key_position[kv_idx] >= read_from[q_idx])
        return own(batch, head, q_idx, kv_idx) | read

    return own if reads is None else own_or_read


def flex_mask(cu_seqlens_q_host: Sequence[int], cu_seqlens_k_host: Sequence[int],
              window: int | None, device: torch.device) -> FlexMask:
    """The mask of a varlen call: segment ``i``'s ``s`` queries over its ``L`` keys, query
    ``t`` reading keys up to ``L - s + t`` (and the ``window`` before it). Kept for the calls
    of a micro-batch's layers (the same boundaries every layer)."""
    return _varlen_mask(tuple(cu_seqlens_q_host), tuple(cu_seqlens_k_host), window, device)


@functools.lru_cache(maxsize=4)
def _varlen_mask(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], window: int | None,
                 device: torch.device) -> FlexMask:
    first, last = np.zeros(bounds_q[-1], np.int64), np.zeros(bounds_q[-1], np.int64)
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        last[qs:qe] = ke - (qe - qs) + np.arange(qe - qs)
        first[qs:qe] = ks if window is None else np.maximum(ks, last[qs:qe] - window + 1)
    return FlexMask(torch.from_numpy(first).to(device), torch.from_numpy(last).to(device),
                    bounds_k[-1])


def plan_flex_mask(plan: SharingPlan, window: int | None = None) -> FlexMask:
    """The plan's tree as a mask over its flat rows (module docstring), built on the host once
    per (plan, window) and kept with the plan (:func:`~prefix_sharing.memo.derived`)."""
    if plan.prefix_runs_host is None or plan.external_rows:
        raise ValueError("a tree mask needs a planner-built plan (prefix_runs_host) of the flat "
                         "rows alone (no stored cross-micro-batch rows)")
    return derived(plan, _plan_mask, window)


def _plan_mask(plan: SharingPlan, window: int | None) -> FlexMask:
    bounds = plan.cu_seqlens_q_host
    rows = plan.num_tokens_flat
    first, last = np.arange(rows), np.arange(rows)
    group = np.zeros(rows, np.int64)
    reads = np.zeros((len(bounds) - 1, rows), bool)
    for i, (qs, qe) in enumerate(zip(bounds[:-1], bounds[1:])):
        first[qs:qe] = qs if window is None else np.maximum(qs, last[qs:qe] - window + 1)
        group[qs:qe] = i
        for start, stop in plan.prefix_runs_host[i]:
            reads[i, start:stop] = True
    position = plan.position_ids.cpu().numpy()
    # every read key precedes the row: without a window, position >= 0 admits them all
    read_from = np.zeros(rows, np.int64) if window is None else position - window + 1
    device = plan.position_ids.device
    tensors = (torch.from_numpy(x).to(device) for x in (first, last, reads, group, read_from))
    first_t, last_t, reads_t, group_t, read_from_t = tensors
    return FlexMask(first_t, last_t, rows, reads=reads_t, group=group_t,
                    key_position=plan.position_ids, read_from=read_from_t)


def flex_rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlexMask,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query row over the key rows ``mask`` lets it read, in one
    FlexAttention call.

    Args:
        q: ``(Tq, nheads, headdim)``.
        k, v: ``(Tk, nheads_k, headdim)`` and ``(Tk, nheads_k, headdim_v)``, same dtype;
            ``nheads % nheads_k == 0`` (query head ``h`` reads key head
            ``h // (nheads // nheads_k)``, FlexAttention's ``enable_gqa``).
        mask: the rows each query reads (:class:`FlexMask`); every query reads at least one.
        softmax_scale: defaults to ``headdim ** -0.5``.

    Returns:
        ``(out, lse)``: ``(Tq, nheads, headdim_v)`` in q's dtype, differentiable in q, k, v
        (FlexAttention's backward; CUDA only in torch 2.13); ``(nheads, Tq)`` float32, the
        natural-log softmax denominator of each row (flash-attn's ``softmax_lse`` layout).
    """
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _flex_attention(q.device)(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        block_mask=mask.block_mask, scale=softmax_scale, enable_gqa=True,
        return_aux=AuxRequest(lse=True))
    return out[0].transpose(0, 1), aux.lse[0].float()


def _flex_attention(device: torch.device) -> Any:
    """FlexAttention compiled on CUDA (fused Triton kernels), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    return _compiled(flex_attention)


@functools.cache
def _compiled(fn: Any) -> Any:
    return torch.compile(fn, dynamic=True)


def varlen_attention_flex(
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
    """Causal varlen attention on FlexAttention: :func:`~.torch_backend.varlen_attention_torch`'s
    signature and meaning (bottom-right causal per segment, ``window`` keys each query sees,
    itself included), the segments as a mask (:func:`flex_mask`). ``sinks``: refused
    (FlexAttention has no sink term in its softmax). ``cu_seqlens_*_host`` are read from the
    device when omitted (:data:`~.backends.READS_HOST_BOUNDARIES`: a planned layer passes
    them)."""
    del max_seqlen_q, max_seqlen_k, kernel_cache
    if sinks is not None:
        raise refuse("kernels.sinks", "FlexAttention")
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    return flex_rows_attention(q, k, v, flex_mask(bounds_q, bounds_k, window, q.device),
                               softmax_scale)[0]


def tree_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SharingPlan,
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plan's attention over its flat rows in one FlexAttention call (execution
    ``"tree_mask"``): q, k, v ``(T_flat, heads, dim)`` of the computed rows, K/V read in place
    through the plan's tree mask (:func:`plan_flex_mask`). ``sinks``: refused."""
    if sinks is not None:
        raise refuse("kernels.sinks", "FlexAttention")
    return flex_rows_attention(q, k, v, plan_flex_mask(plan, window), softmax_scale)[0]
