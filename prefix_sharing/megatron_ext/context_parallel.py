"""Context parallelism over the plan's flat layout: each rank computes a contiguous slice of rows.

The flat layout holds only the computed (unique) tokens, padded to a multiple of ``CP x TP``;
CP rank ``r`` holds rows ``[r * T_flat / CP, (r + 1) * T_flat / CP)``. A plain contiguous split,
not megatron's zigzag: the plan knows every row's segment, so a rank's query segments are simply
the intersections of its slice with the plan's segments, and nothing has to be permuted back.
The price is load balance (the last rank's rows see the longest key ranges); zigzag is a
refinement that changes only :func:`slice_plan`.

Attention (:class:`~.core_attention.PrefixSharingCoreAttention`): every rank all-gathers K and V
of the whole flat layout over the CP group (megatron's sequence-parallel gather: all-gather in
the forward, reduce-scatter of dK / dV in the backward), then runs its local query rows over
them. A local piece ``[a, b)`` of a query tail of length ``s`` over ``L`` keys sees the first
``L - s + b`` keys, bottom-right aligned, which is exactly what the plain segment gives those
queries. Over key sources (``runnable_layout(plan, backend, rows=(row_start, row_stop))``, K/V
in place) on the torch kernel, and on the NPU kernel unless a window cuts a shared node;
otherwise (flash-attn, TE) through this slice's ``kv_gather_index`` (each piece's keys copied
together). Works for any head count.

Bytes per layer and rank (:func:`kv_bytes_per_layer`): the forward receives
``2 * (CP - 1) / CP * T_flat * kv_heads * head_dim * dtype_bytes`` (K and V) and the backward
sends as much (reduce-scatter). ``T_flat`` is the *computed* token count, so sharing cuts CP
traffic by the plan's token ratio against plain CP over ``T_total`` tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..plan import SharingPlan

__all__ = ["ContextParallelSlice", "slice_plan", "gather_rows", "kv_bytes_per_layer"]


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelSlice:
    """This CP rank's rows of a plan and its attention segments, built once per micro-batch.

    Worked example: the plan of :class:`~prefix_sharing.plan.SharingPlan`'s docstring (segments
    ``a`` = rows 0..3 over 4 keys, ``b`` = rows 4..5 over keys ``[0 1 2 4 5]``) split over two
    ranks (3 rows each)::

        rank 0: rows 0..2   cu_seqlens_q = [0 3]     cu_seqlens_kv = [0 3]
                            kv_gather_index = [0 1 2]            (a's first 3 queries)
        rank 1: rows 3..5   cu_seqlens_q = [0 1 3]   cu_seqlens_kv = [0 4 9]
                            kv_gather_index = [0 1 2 3 | 0 1 2 4 5]

    Attributes:
        group: the context-parallel process group.
        size, rank: its size and this rank's index in it.
        row_start, row_stop: this rank's rows of the flat layout.
        cu_seqlens_q, cu_seqlens_kv: ``(m + 1,)`` int32, the local query pieces and their keys.
        cu_seqlens_q_host, cu_seqlens_kv_host: the same as host ints.
        max_seqlen_q, max_seqlen_kv: longest local query piece / key range.
        kv_gather_index: rows of the all-gathered flat K/V, key range by key range.
        position_ids: ``(row_stop - row_start,)`` the local rows' positions (RoPE).
        token_positions: packed positions (``plan.kv_index`` order) whose row is local: the
            log-probs this rank computes.
    """

    group: torch.distributed.ProcessGroup
    size: int
    rank: int
    row_start: int
    row_stop: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_host: tuple[int, ...]
    cu_seqlens_kv_host: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_kv: int
    kv_gather_index: torch.Tensor
    position_ids: torch.Tensor
    token_positions: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start


def slice_plan(
    plan: SharingPlan,
    rank: int,
    size: int,
    group: torch.distributed.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> ContextParallelSlice:
    """CP rank ``rank``'s (of ``size``) :class:`ContextParallelSlice` of a host (CPU) ``plan``,
    tensors on ``device``; ``group`` is the CP group its attention gathers over.

    ``plan.num_tokens_flat`` must divide by ``size`` (``prepare_micro_batch`` pads it).
    """
    if plan.num_tokens_flat % size:
        raise ValueError(
            f"the flat layout has {plan.num_tokens_flat} rows, not a multiple of the "
            f"context-parallel size {size}: plan with pad_to_multiple_of = CP x TP"
        )
    per_rank = plan.num_tokens_flat // size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    cu_q, cu_kv = np.asarray(plan.cu_seqlens_q_host), np.asarray(plan.cu_seqlens_kv_host)
    gather = plan.kv_gather_index.cpu().numpy()
    q_lens, kv_lens, pieces = [], [], []
    for qs, qe, ks, ke in zip(cu_q[:-1], cu_q[1:], cu_kv[:-1], cu_kv[1:]):
        a, b = max(qs, lo) - qs, min(qe, hi) - qs  # the local queries of this tail
        if b <= a:
            continue
        keys = (ke - ks) - (qe - qs) + b  # bottom-right: query b - 1 sees keys 0 .. keys - 1
        q_lens.append(b - a)
        kv_lens.append(keys)
        pieces.append(gather[ks : ks + keys])
    cu_q_local = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_kv_local = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    kv_index = plan.kv_index.cpu().numpy()
    positions = np.flatnonzero((kv_index >= lo) & (kv_index < hi))
    return ContextParallelSlice(
        group=group,
        size=size,
        rank=rank,
        row_start=lo,
        row_stop=hi,
        cu_seqlens_q=torch.from_numpy(cu_q_local).to(device),
        cu_seqlens_kv=torch.from_numpy(cu_kv_local).to(device),
        cu_seqlens_q_host=tuple(cu_q_local.tolist()),
        cu_seqlens_kv_host=tuple(cu_kv_local.tolist()),
        max_seqlen_q=int(max(q_lens)),
        max_seqlen_kv=int(max(kv_lens)),
        kv_gather_index=torch.from_numpy(np.concatenate(pieces)).to(device),
        position_ids=plan.position_ids[lo:hi].to(device),
        token_positions=torch.from_numpy(positions).to(device),
    )


def gather_rows(x: torch.Tensor, cp: ContextParallelSlice) -> torch.Tensor:
    """``(T_local, ...)`` rows of every CP rank, concatenated in rank order: ``(T_flat, ...)``.

    Differentiable: the backward reduce-scatters the gradient, so each rank gets the sum of
    every rank's gradient for its own rows (megatron's sequence-parallel gather, on the CP
    group).
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, group=cp.group)


def kv_bytes_per_layer(
    num_rows: int, cp_size: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes one rank receives per attention layer in the forward K/V all-gather (and sends in
    the backward reduce-scatter): ``2 * (CP - 1) / CP * num_rows * kv_heads * head_dim * bytes``.

    ``num_rows`` is the flat layout's length: ``plan.num_tokens_flat`` shared, or the plain
    token count for plain CP. ``kv_heads`` is this tensor-parallel rank's K/V heads.
    """
    return 2 * (cp_size - 1) * (num_rows // cp_size) * kv_heads * head_dim * dtype_bytes
