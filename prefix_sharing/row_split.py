"""A plan's flat layout cut into equal contiguous row ranges, one per sequence-parallel rank.

DeepSpeed-Ulysses sequence parallelism (verl's ``ulysses_sequence_parallel_size``) gives each
rank of its group an equal contiguous slice of the packed row: verl pads the row at its end to a
multiple of the group size, then rank ``r`` takes rows ``[r * T / n, (r + 1) * T / n)``. Under
sharing the row is the plan's flat layout (``plan.input_ids`` / ``plan.position_ids``), padded
the same way by the planner (``build_plan(pad_to_multiple_of=n)``: the pad rows form their own
causal segment, as verl's pad tokens restart their positions at 0). Each rank then runs the
layers on its rows; the attention's all-to-all (:mod:`prefix_sharing.fsdp_compat.ulysses`)
hands every rank the whole flat layout for its share of heads, so the attention itself reads
the whole plan, never a slice of it.

The log-probs split along the same rows: a packed position (``plan.kv_index`` order) is scored
by the rank that holds its row, so each position is computed exactly once across the group -
a shared prefix row is normalised once, on its rank, for every sequence that reads it.

Framework-free: a pure function of the plan, the group size and the rank.
"""

from __future__ import annotations

import dataclasses

import torch

from .plan import SharingPlan

__all__ = ["RowSplit", "split_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class RowSplit:
    """One rank's rows of a plan's flat layout.

    Worked example: the plan of :class:`~prefix_sharing.plan.SharingPlan`'s docstring (6 flat
    rows; sequences ``a``, ``b``, ``c`` read rows ``[0 1 2 3 | 0 1 2 4 5 | 0 1]``) over two
    ranks::

        rank 0: rows 0..2   positions = [0 1 2 | 4 5 6 | 9 10]   (the packed positions
        rank 1: rows 3..5   positions = [3 | 7 8]                  reading those rows)

    Attributes:
        size, rank: the group's size and this rank's index in it.
        row_start, row_stop: this rank's rows ``[row_start, row_stop)`` of the flat layout.
        positions: ``(P,)`` int64, the packed positions whose row is this rank's, ascending.
    """

    size: int
    rank: int
    row_start: int
    row_stop: int
    positions: torch.Tensor

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a ``(T_flat, ...)`` tensor of the plan (``plan.input_ids``,
        ``plan.position_ids``)."""
        return flat[self.row_start:self.row_stop]


def split_rows(plan: SharingPlan, rank: int, size: int) -> RowSplit:
    """Rank ``rank``'s (of ``size``) :class:`RowSplit` of ``plan``, whose flat layout must
    divide by ``size`` (plan with ``build_plan(pad_to_multiple_of=size)``, as verl pads its
    packed row for Ulysses). ``positions`` lies on ``plan.kv_index``'s device."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    if plan.num_tokens_flat % size:
        raise ValueError(
            f"the flat layout has {plan.num_tokens_flat} rows, not a multiple of the "
            f"sequence-parallel size {size}: plan with build_plan(pad_to_multiple_of={size})")
    per_rank = plan.num_tokens_flat // size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    local = (plan.kv_index >= lo) & (plan.kv_index < hi)
    return RowSplit(size, rank, lo, hi, local.nonzero().flatten())
