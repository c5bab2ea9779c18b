"""Suffix micro-batch boundaries of a cross-micro-batch group: fewest pieces, equal cost.

Below a shared node, :func:`~prefix_sharing.cross_micro_batch.plan_group` has a row of
*units* in lexicographic order (a branch kept whole, or one tail of a branch that is cut),
each fitting the token budget alone. They go into contiguous suffix micro-batches: as few as
the budget allows (a greedy fill by computed tokens gives that count), their boundaries then
placed at equal *cost* by the cost model (:mod:`~prefix_sharing.batching.cost`): computed
tokens plus attended pairs over ``keys_per_token``, where a suffix attends the whole stack of
prefix rows it reads, so a tail costs more than its tokens. The budget stays the hard bound
on every piece's computed tokens; where equal-cost boundaries would break it the count grows
by one, as the chunking of a long prefix does.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["pack_at_equal_cost"]

Members = list[int]


def pack_at_equal_cost(units: list[Members], fits: Callable[[Members], bool],
                       cost: Callable[[Members], float]) -> list[Members]:
    """``units`` (each fitting alone) as contiguous pieces that fit: the fewest, at equal cost.

    Args:
        units: the members of each unit, in packing order.
        fits: whether a piece's computed tokens are within the budget (monotone: a piece
            that fits stays fitting when a unit is dropped from either end).
        cost: a unit's cost; a piece is weighed as the sum of its units' (units at one
            depth share nothing but the stack above them, which every cost includes).
    """
    if not units:
        return []
    count, current = 1, []
    for unit in units:  # the greedy fill: the fewest contiguous pieces
        if current and not fits(current + unit):
            count, current = count + 1, []
        current += unit
    sums = [0.0]
    for unit in units:
        sums.append(sums[-1] + cost(unit))
    while (pieces := _at_equal_cost(units, count, sums, fits)) is None:
        count += 1
    return pieces


def _at_equal_cost(units: list[Members], count: int, sums: list[float],
                   fits: Callable[[Members], bool]) -> list[Members] | None:
    """``count`` pieces, piece ``j`` ending where the running cost is nearest ``j / count``
    of the total (within the budget, each piece at least one unit); None when the last
    piece would not fit."""
    n, bounds, a = len(units), [], 0
    for j in range(1, count):
        target, b = sums[n] * j / count, a + 1
        while (b < n - (count - j) and sums[b] < target
               and sums[b + 1] - target <= target - sums[b]
               and fits([i for u in units[a:b + 1] for i in u])):
            b += 1
        bounds.append((a, b))
        a = b
    bounds.append((a, n))
    pieces = [[i for u in units[a:b] for i in u] for a, b in bounds]
    return pieces if fits(pieces[-1]) else None
