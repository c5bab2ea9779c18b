"""The plain micro-batch as an MoE router sees it, addressed in the flat rows of a plan.

A leaf of :mod:`.moe` (the router's batch statistics over the plain batch) and
:mod:`.routing_replay` (each flat row's recorded route is its first reader's): both read where
every plain position takes its flat row, neither needs the other.
"""

from __future__ import annotations

import dataclasses

import torch

from ..memo import derived
from ..plan import SharingPlan

__all__ = ["PlainBatchView", "plain_batch_view"]


@dataclasses.dataclass(frozen=True)
class PlainBatchView:
    """Where each position of the plain micro-batch reads its flat row, for the router.

    Worked example, the plan of :class:`~prefix_sharing.plan.SharingPlan` (``a = [5 6 7 8]``,
    ``b = [5 6 7 9 9]``, ``c = [5 6]``; 6 flat rows, sentinel 6), per sequence, one shard::

        rows = [[0 0 0]       one column per sequence, one row per position ([s, b])
                [1 1 1]
                [2 2 6]
                [3 4 6]
                [6 5 6]]
        padding_mask = rows == 6
        readers = [0 3 6 9 10 13]   a flat row's first position in the plain batch, rows.view(-1)

    Under sequence parallelism with 2 shards, ``s`` is rounded up to 6 (a padding row of 6s
    appended) and split like megatron splits the plain ``[s, b]`` batch: rank 0 routes
    ``rows[:3]``, rank 1 ``rows[3:]``; each rank's ``readers`` are those of its own half of the
    flat rows, as positions of the whole plain batch (``[0 3 6]`` on rank 0, ``[9 10 13]`` on
    rank 1), since a flat row's readers may sit in the other rank's half.

    Without per-sequence statistics and sequence parallelism the view is the plain batch as one
    packed sequence, ``rows = kv_index[:, None]`` (no padding), which is smaller when lengths
    differ a lot.

    Attributes:
        rows: ``[s / shards, b]`` int64, the flat row of every plain position of this shard;
            ``num_tokens_flat`` (the sentinel, a row of zeros) where a sequence is shorter
            than ``s``.
        padding_mask: ``[s / shards, b]`` bool, True at the sentinel (megatron's convention), or
            None.
        readers: ``(T_flat / shards,)`` int64, for each flat row of this shard one position of
            the whole plain batch (all shards' ``rows.view(-1)`` concatenated) that reads it; the
            plan's pad rows, which no sequence reads, take position 0.
        z_loss_weights: ``[s / shards, b]`` float32, or None: each position's weight in the
            z-loss of the unsplit batch routed in ``z_loss_slices`` sequence-parallel slices
            (``1 / (z_loss_slices * n)``, ``n`` the real tokens of the slice holding it; 0 at
            padding). Under context parallelism, where ``shards`` is ``TP x CP``.

    With ``external_rows`` (a suffix micro-batch across micro-batches, whose ``kv_index``
    addresses its group's ``external_rows`` prefix rows first) the rows index ``cat(prefix
    rows, flat rows)``, the sentinel is ``external_rows + T_flat`` and ``readers`` cover the
    flat rows only (this shard's, under sequence parallelism).
    """

    rows: torch.Tensor
    padding_mask: torch.Tensor | None
    readers: torch.Tensor
    z_loss_weights: torch.Tensor | None = None

    @classmethod
    def of(cls, plan: SharingPlan, per_sequence: bool, shards: int = 1,
           shard: int = 0, z_loss_slices: int | None = None,
           external_rows: int = 0) -> PlainBatchView:
        """Shard ``shard`` of ``shards`` of the view of ``plan``: padded per sequence, or the
        packed plain batch (one shard only); with ``z_loss_slices``, its z-loss weights; with
        ``external_rows``, over a group's prefix rows (held whole by every shard) and then
        the flat rows."""
        if plan.num_tokens_flat % shards:
            raise ValueError(f"the flat layout's {plan.num_tokens_flat} rows do not split into "
                             f"{shards} sequence-parallel shards; plan with pad_to_multiple_of="
                             f"{shards}")
        if shards > 1 and not per_sequence:
            raise ValueError("the packed plain batch has one shard; shard it per sequence")
        kv_index = plan.kv_index
        sentinel = external_rows + plan.num_tokens_flat
        if per_sequence:
            packed = torch.arange(plan.num_tokens_total, device=kv_index.device)
            seq = torch.searchsorted(plan.cu_seqlens[1:], packed, right=True)
            pos = packed - plan.cu_seqlens.index_select(0, seq)
            length = max(plan.seq_lens)
            length += -length % shards  # megatron splits the padded s evenly
            rows = torch.full((length, plan.num_sequences), sentinel,
                              dtype=torch.int64, device=kv_index.device)
            rows[pos, seq] = kv_index  # [s, b]
        else:
            rows = kv_index.unsqueeze(1)  # [T_total, 1]
        positions = torch.arange(rows.numel(), device=kv_index.device)
        # one slot more, for the sentinel: padding positions land there and are dropped
        readers = torch.zeros(sentinel + 1, dtype=torch.int64,
                              device=kv_index.device)
        readers.scatter_reduce_(0, rows.reshape(-1), positions, "amin", include_self=False)
        weights = None
        if z_loss_slices is not None:
            if not per_sequence:
                raise ValueError("z-loss weights are those of the padded plain batch")
            weights = _z_loss_weights(rows != sentinel, max(plan.seq_lens),
                                      z_loss_slices).chunk(shards)[shard]
        rows = rows.chunk(shards)[shard]
        return cls(rows, rows == sentinel if per_sequence else None,
                   readers[external_rows:-1].chunk(shards)[shard], weights)

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """``[s / shards, b, E]`` this shard's plain-batch rows of all flat rows ``[T_flat, E]``
        (``[external_rows + T_flat, E]`` with external rows; zeros at padding)."""
        with_sentinel = torch.cat([flat, flat.new_zeros(1, flat.size(1))])  # [rows + 1, E]
        return with_sentinel.index_select(0, self.rows.reshape(-1)).view(*self.rows.shape, -1)

    def select(self, plain: torch.Tensor) -> torch.Tensor:
        """This shard's flat ``[T_flat / shards, E]`` rows of the whole plain batch
        ``[s * b, E]``: each row's first reader."""
        return plain.index_select(0, self.readers)


def _z_loss_weights(real: torch.Tensor, longest: int, slices: int) -> torch.Tensor:
    """``[s, b]`` weights of the real positions ``real`` (``[s, b]`` bool, ``s >= longest``)
    in the z-loss megatron computes when ``slices`` sequence-parallel ranks route the batch
    padded to ``longest`` rounded up to ``slices``: each slice's mean over its real tokens,
    divided by ``slices``."""
    per_slice = -(-longest // slices)  # rows of s each slice holds
    slice_of = (torch.arange(real.size(0), device=real.device) // per_slice).clamp(max=slices - 1)
    real = real.float()
    counts = torch.zeros(slices, device=real.device).index_add_(0, slice_of, real.sum(1))
    return real / (slices * counts.clamp(min=1)).index_select(0, slice_of).unsqueeze(1)


def plain_batch_view(plan: SharingPlan, per_sequence: bool, shards: int = 1,
                     shard: int = 0, z_loss_slices: int | None = None,
                     external_rows: int = 0) -> PlainBatchView:
    """:meth:`PlainBatchView.of`, built once per plan and arguments and shared by every MoE
    layer of the micro-batch (:mod:`prefix_sharing.memo`)."""
    return derived(plan, PlainBatchView.of, per_sequence, shards, shard,
                   z_loss_slices, external_rows)
