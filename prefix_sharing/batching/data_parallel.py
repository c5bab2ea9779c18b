"""Partitions a batch over data-parallel ranks so that what is shared stays on one rank.

verl's trainer balances the batch over data-parallel ranks by sequence length alone before any
plan is built, and a GRPO group's responses land on different ranks: each rank computes the
prompt again (measured on 64 prompts x 8 responses at dp = 8: 1.13x fewer tokens than the
batch holds, against 1.42x with each group on one rank). Here the unit is the sharing group
(:func:`~prefix_sharing.batching.groups.sharing_groups`: uid groups, else prefix trees), and
ranks are balanced by what they compute (:mod:`~prefix_sharing.batching.cost`).

How:

1. Each group's plan is built once, alone: its computed tokens and cost. Groups on different
   ranks share nothing, so a rank's load is the sum of its groups' costs.
2. Costliest group first onto the least-loaded rank with room for it (longest-processing-time
   first); with ``equal_size`` a rank has room for ``len(batch) / dp_size`` samples. The
   same is tried taking the largest groups first (it packs counts more tightly) and, when
   both leave groups without room, filling rank after rank with a set of groups whose
   counts add up exactly (subset sum); the try that leaves fewer groups without room wins,
   then the better balance.
3. A group with no room left anywhere is cut (counted in ``groups_split``): a run of the
   rank's free count from either end of its lexicographic order
   (:func:`~prefix_sharing.batching.groups.lexicographic_order`, where sub-trees are runs),
   taken at the end whose neighbours part at the shallower depth, onto the rank with the most
   room. Synthetic padding samples (verl's ``upsample_batch_to_divisible_size``) belong to
   no group: they fill what room is left.
4. Exchanges of one or two units for one or two of the same sample count (any exchange or
   move without ``equal_size``) between the costliest rank and another, while they lower the
   larger of the two loads.
5. With ``mini_batch_size`` each rank's samples are ordered so that its consecutive runs of
   ``mini_batch_size`` (verl's ``ppo_mini_batch_size x rollout.n / dp``) hold whole groups:
   each run takes a set of groups that fills it exactly when one exists, else groups largest
   first and a cut of the last (counted in ``mini_batch_groups_split``). A rank's runs go
   costliest first: the j-th mini-batch of a step is every rank's j-th run, so the ranks'
   j-th costliest meet and wait on each other least.

Everything depends on token ids, uids, the flags and the config only (no hash or set order),
so every process builds the same partition.

The figures reported per rank (:func:`rank_measures`) count each group's part on the rank with
its own plan, as the ideal counts each group: what the rank computes when its micro-batches do
not mix groups. Sharing *between* groups (a system prompt common to all uid groups, found by
``arbitrary_prefix`` in a micro-batch that holds several) is not counted in either, so the
rank ratio never exceeds the ideal and equals it exactly when no group is cut.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable, Sequence

from ..config import PrefixSharingConfig
from ..errors import InputError
from ..planner import TokenSequence
from .cost import CostModel, Measure, SubsetMeasure, check_batch, check_positive_int
from .groups import lexicographic_order, sharing_groups

__all__ = ["DataParallelPartition", "partition_data_parallel", "rank_measures"]


@dataclasses.dataclass(frozen=True)
class DataParallelPartition:
    """Batch indices per data-parallel rank, and what each rank computes.

    Attributes:
        partitions: per rank, the batch indices it gets, in the order it gets them.
        tokens_total: per rank, the tokens of its samples (what the plain forward runs).
        tokens_computed: per rank, the tokens its groups' parts compute, each planned alone
            (:func:`rank_measures`).
        cost: per rank, their cost (:func:`~prefix_sharing.batching.computed_cost`).
        ideal_tokens_computed: the tokens computed with every sharing group whole on one rank
            (each group's plan alone, plus each padding sample alone).
        num_groups: sharing groups in the batch (padding samples not counted).
        groups_split: groups whose samples landed on more than one rank.
        mini_batch_groups_split: groups whose samples on one rank straddle a mini-batch
            boundary (0 without ``mini_batch_size``).
    """

    partitions: tuple[tuple[int, ...], ...]
    tokens_total: tuple[int, ...]
    tokens_computed: tuple[int, ...]
    cost: tuple[float, ...]
    ideal_tokens_computed: int
    num_groups: int = 0
    groups_split: int = 0
    mini_batch_groups_split: int = 0

    @property
    def order(self) -> list[int]:
        """The partitions concatenated: what verl's ``reorder`` takes before it deals the
        batch to the ranks in equal chunks."""
        return [i for partition in self.partitions for i in partition]

    @property
    def token_ratio(self) -> float:
        """Tokens of the batch over the tokens all ranks compute."""
        return sum(self.tokens_total) / sum(self.tokens_computed)

    @property
    def ideal_token_ratio(self) -> float:
        """Tokens of the batch over the tokens computed with every group on one rank."""
        return sum(self.tokens_total) / self.ideal_tokens_computed

    @property
    def cost_imbalance(self) -> float:
        """The costliest rank's cost over the mean: 1.0 is a perfect balance."""
        return max(self.cost) * len(self.cost) / sum(self.cost)

    def metrics(self, prefix: str = "prefix_sharing/") -> dict[str, float]:
        """The figures a trainer logs per step."""
        return {
            f"{prefix}dp_token_ratio": self.token_ratio,
            f"{prefix}dp_ideal_token_ratio": self.ideal_token_ratio,
            f"{prefix}dp_cost_imbalance": self.cost_imbalance,
            f"{prefix}dp_groups_split": float(self.groups_split),
        }


@dataclasses.dataclass(frozen=True)
class _Unit:
    """Samples that move together: a group, a piece of one, or a padding sample (group -1)."""

    members: tuple[int, ...]  # ascending
    tokens: int
    cost: float
    group: int


def partition_data_parallel(
    sequences: Sequence[TokenSequence],
    dp_size: int,
    config: PrefixSharingConfig | None = None,
    *,
    uids: Sequence[Hashable] | None = None,
    prompt_lens: Sequence[int] | None = None,
    equal_size: bool = True,
    mini_batch_size: int | None = None,
    padding: Sequence[bool] | None = None,
    cost_model: CostModel | None = None,
) -> DataParallelPartition:
    """Deals the batch to ``dp_size`` ranks: sharing groups whole, ranks balanced by cost.

    Args:
        sequences: the batch, one 1-D token-id sequence per sample (as for ``build_plan``).
        dp_size: data-parallel ranks.
        config: what is shared (``PrefixSharingConfig()`` when omitted).
        uids: one id per sample (verl's ``uid``): the groups. Without uids, groups are the
            sequences the planner links by shared prefixes.
        prompt_lens: per-sample prompt length; needed with ``mode="prompt_only"``.
        equal_size: every rank gets ``len(sequences) / dp_size`` samples (verl's dispatch
            deals the reordered batch in equal chunks); groups are cut only where whole
            groups cannot give equal counts.
        mini_batch_size: samples per rank per mini-batch; each rank's order keeps groups
            inside one mini-batch where it can. Needs ``equal_size`` and must divide the
            rank's sample count.
        padding: per sample, whether it is a synthetic padding sample: in no group, it fills
            counts.
        cost_model: how a rank's load is weighed (verl's ratio by default).

    Returns:
        The :class:`DataParallelPartition` (module doc: how it is found).

    Raises:
        InputError: bad input (named in the message).
    """
    config = PrefixSharingConfig() if config is None else config
    n = len(sequences)
    padding = [False] * n if padding is None else [bool(p) for p in padding]
    _check_arguments(n, dp_size, config, uids, prompt_lens, equal_size, mini_batch_size, padding)
    measure = SubsetMeasure(sequences, config, uids, prompt_lens, cost_model)

    real = [i for i in range(n) if not padding[i]]
    real_uids = None if uids is None else [uids[i] for i in real]
    real_sequences = [sequences[i] for i in real]
    groups = [] if not real else [
        [real[j] for j in g] for g in sharing_groups(real_sequences, config, real_uids)]
    whole = [_unit(tuple(g), g_index, measure) for g_index, g in enumerate(groups)]
    pads = [_unit((i,), -1, measure) for i in range(n) if padding[i]]
    capacity = n // dp_size if equal_size else None

    ranks = _assign(whole, pads, dp_size, capacity, sequences, measure)
    _refine(ranks, equal_size)
    if mini_batch_size is None:
        ordered = [sorted(r, key=lambda u: u.members[0]) for r in ranks]
    else:
        ordered = [_mini_batch_order(r, mini_batch_size, sequences, measure) for r in ranks]
    partitions = tuple(tuple(i for u in r for i in u.members) for r in ordered)

    figures = rank_measures(partitions, groups, measure)
    lengths = [len(s) for s in sequences]
    ideal = sum(u.tokens for u in whole) + sum(u.tokens for u in pads)
    return DataParallelPartition(
        partitions=partitions,
        tokens_total=tuple(sum(lengths[i] for i in p) for p in partitions),
        tokens_computed=tuple(tokens for tokens, _ in figures),
        cost=tuple(cost for _, cost in figures),
        ideal_tokens_computed=ideal,
        num_groups=len(groups),
        groups_split=_groups_split(ordered),
        mini_batch_groups_split=_mini_batch_splits(ordered, mini_batch_size),
    )


def rank_measures(partitions: Sequence[Sequence[int]], groups: Sequence[Sequence[int]],
                  measure: SubsetMeasure) -> list[Measure]:
    """Per rank, the tokens and cost of its part of each group, each part planned alone
    (samples in no group, like verl's padding samples, each alone): the unit the ideal is
    counted in (see the module doc)."""
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    figures = []
    for partition in partitions:
        parts: dict[int | tuple[str, int], list[int]] = {}
        for i in sorted(partition):
            parts.setdefault(group_of.get(i, ("alone", i)), []).append(i)
        measured = [measure.measure(members) for members in parts.values()]
        figures.append(Measure(sum(m.tokens for m in measured), sum(m.cost for m in measured)))
    return figures


def _check_arguments(n: int, dp_size: int, config: PrefixSharingConfig,
                     uids: Sequence[Hashable] | None, prompt_lens: Sequence[int] | None,
                     equal_size: bool, mini_batch_size: int | None,
                     padding: list[bool]) -> None:
    check_batch("partition_data_parallel", n, config, uids=uids, prompt_lens=prompt_lens,
                padding=padding)
    check_positive_int("dp_size", dp_size)
    if not equal_size:
        if mini_batch_size is not None:
            raise InputError("mini_batch_size needs equal_size=True: mini-batches are cut from "
                             "equal per-rank shares")
        return
    if n < dp_size:
        raise InputError(f"equal_size=True gives every one of dp_size={dp_size} ranks a sample, "
                         f"but the batch has only {n}")
    if n % dp_size:
        raise InputError(
            f"equal_size=True gives every rank the same number of samples, but {n} samples do "
            f"not divide over dp_size={dp_size}: pad the batch to a multiple of {dp_size} "
            "(verl's upsample_batch_to_divisible_size, marked with padding=) or pass "
            "equal_size=False")
    if mini_batch_size is not None:
        check_positive_int("mini_batch_size", mini_batch_size)
        if (n // dp_size) % mini_batch_size:
            raise InputError(
                f"mini_batch_size={mini_batch_size} (ppo_mini_batch_size x rollout.n / dp) does "
                f"not divide the {n // dp_size} samples each of dp_size={dp_size} ranks gets")


def _unit(members: tuple[int, ...], group: int, measure: SubsetMeasure) -> _Unit:
    return _Unit(members, *measure.measure(members), group)


def _assign(whole: list[_Unit], pads: list[_Unit], dp_size: int, capacity: int | None,
            sequences: Sequence[TokenSequence], measure: SubsetMeasure) -> list[list[_Unit]]:
    """Steps 2 and 3 of the module doc: whole groups by two orders, the better kept; groups
    without room cut into the ranks with the most room; padding samples into what is left."""
    by_cost = sorted(whole, key=lambda u: (-u.cost, u.members[0]))
    by_size = sorted(whole, key=lambda u: (-len(u.members), -u.cost, u.members[0]))
    tries = [_place_whole(order, dp_size, capacity) for order in (by_cost, by_size)]
    if capacity is not None and tries[0][1] and tries[1][1]:
        tries.append(_fill_exactly(by_cost, dp_size, capacity))
    ranks, deferred = min(tries, key=lambda t: (len(t[1]), _max_load(t[0])))
    for unit in deferred:
        rest = unit
        while rest is not None:
            r = max(range(dp_size), key=lambda r: (_room(ranks[r], capacity), -_load(ranks[r]), -r))
            piece, rest = _split_off(rest, _room(ranks[r], capacity), sequences, measure)
            ranks[r].append(piece)
    for pad in pads:
        fits = [r for r in range(dp_size) if _room(ranks[r], capacity) > 0]
        ranks[min(fits, key=lambda r: (_load(ranks[r]), r))].append(pad)
    return ranks


def _place_whole(order: list[_Unit], dp_size: int, capacity: int | None,
                 ranks: list[list[_Unit]] | None = None,
                 ) -> tuple[list[list[_Unit]], list[_Unit]]:
    """Each unit onto the least-loaded rank with room for it (onto ``ranks`` as they are,
    when given); those without room returned."""
    ranks = [[] for _ in range(dp_size)] if ranks is None else ranks
    loads = [_load(r) for r in ranks]
    counts = [sum(len(u.members) for u in r) for r in ranks]
    deferred = []
    for unit in order:
        size = len(unit.members)
        fits = [r for r in range(dp_size) if capacity is None or counts[r] + size <= capacity]
        if not fits:
            deferred.append(unit)
            continue
        r = min(fits, key=lambda r: (loads[r], r))
        ranks[r].append(unit)
        loads[r] += unit.cost
        counts[r] += size
    return ranks, deferred


def _fill_exactly(order: list[_Unit], dp_size: int,
                  capacity: int) -> tuple[list[list[_Unit]], list[_Unit]]:
    """Rank after rank, a set of the remaining units whose sample counts fill it exactly
    (costliest units first), where one exists; the units left over returned."""
    ranks: list[list[_Unit]] = [[] for _ in range(dp_size)]
    remaining = list(order)
    for rank in ranks:
        chosen = _exact_fill(remaining, capacity) or []
        rank += chosen
        remaining = [u for u in remaining if all(u is not c for c in chosen)]
    return _place_whole(remaining, dp_size, capacity, ranks)


def _split_off(unit: _Unit, size: int, sequences: Sequence[TokenSequence],
               measure: SubsetMeasure) -> tuple[_Unit, _Unit | None]:
    """``size`` of the unit's samples (all when it has no more), and the rest: a run from the
    end of its lexicographic order whose cut parts the shallower shared prefix."""
    if len(unit.members) <= size:
        return unit, None
    ordered, parting = lexicographic_order(unit.members, sequences)
    m = len(ordered)
    piece = ordered[:size] if parting[size] <= parting[m - size] else ordered[m - size:]
    rest = tuple(sorted(set(unit.members).difference(piece)))
    return (_unit(tuple(sorted(piece)), unit.group, measure),
            _unit(rest, unit.group, measure))


def _refine(ranks: list[list[_Unit]], equal_size: bool) -> None:
    """Step 4 of the module doc: the best exchange off the costliest rank - one of its units
    (or two, on ranks of at most :data:`_PAIRED_UNITS` units) for one or two of another's
    with the same sample count (without ``equal_size``: of any count, or none) - repeated
    while it lowers the larger of the two loads. Each step lowers the sorted loads
    lexicographically, so it ends."""
    for _ in range(64 * sum(map(len, ranks))):
        loads = [_load(r) for r in ranks]
        hi = max(range(len(ranks)), key=lambda r: (loads[r], -r))
        best, best_peak = None, loads[hi] * (1 - 1e-12)
        gives = _subsets(ranks[hi])
        for r in range(len(ranks)):
            if r == hi:
                continue
            offers = _offers(ranks[r], equal_size)
            for give, cost_give, size in gives:
                # the best take costs half the gap less than the give: its neighbours by cost
                costs, takes = offers.get(size if equal_size else 0, ([], []))
                at = bisect.bisect_left(costs, cost_give - (loads[hi] - loads[r]) / 2)
                for k in range(max(0, at - 1), min(len(costs), at + 1)):
                    peak = max(loads[hi] - cost_give + costs[k], loads[r] + cost_give - costs[k])
                    if peak < best_peak:
                        best, best_peak = (r, give, takes[k]), peak
        if best is None:
            return
        r, give, take = best
        moved = [ranks[hi][k] for k in give]
        back = [ranks[r][k] for k in take]
        ranks[hi][:] = [u for k, u in enumerate(ranks[hi]) if k not in give] + back
        ranks[r][:] = [u for k, u in enumerate(ranks[r]) if k not in take] + moved


_PAIRED_UNITS = 16  # above this many units a rank exchanges single units only (pairs: n**2)


def _subsets(rank: list[_Unit]) -> list[tuple[tuple[int, ...], float, int]]:
    """The rank's units one at a time, and two at a time on small ranks:
    (indices, cost, sample count)."""
    out = [((a,), u.cost, len(u.members)) for a, u in enumerate(rank)]
    if len(rank) <= _PAIRED_UNITS:
        out += [((a, b), rank[a].cost + rank[b].cost,
                 len(rank[a].members) + len(rank[b].members))
                for a in range(len(rank)) for b in range(a + 1, len(rank))]
    return out


def _offers(rank: list[_Unit], equal_size: bool,
            ) -> dict[int, tuple[list[float], list[tuple[int, ...]]]]:
    """What a rank can give back, by sample count (all under 0 without ``equal_size``, with
    giving nothing), each as costs ascending and the matching unit indices."""
    by_size: dict[int, list[tuple[float, tuple[int, ...]]]] = {}
    for indices, cost, size in _subsets(rank):
        by_size.setdefault(size if equal_size else 0, []).append((cost, indices))
    if not equal_size:
        by_size.setdefault(0, []).append((0.0, ()))
    return {size: ([c for c, _ in sorted(o)], [i for _, i in sorted(o)])
            for size, o in by_size.items()}


def _mini_batch_order(rank: list[_Unit], mini_batch_size: int,
                      sequences: Sequence[TokenSequence], measure: SubsetMeasure) -> list[_Unit]:
    """Step 5 of the module doc: the rank's units in mini-batch runs, each filled exactly by
    whole units where some set of them fits, else largest first and the last one cut; the
    costliest run first."""
    remaining = sorted(rank, key=lambda u: (-len(u.members), u.members[0]))
    runs: list[list[_Unit]] = []
    while remaining:
        room, run = mini_batch_size, []
        while room:
            exact = _exact_fill(remaining, room)
            if exact is not None:
                run += exact
                remaining = [u for u in remaining if all(u is not e for e in exact)]
                break
            unit = remaining.pop(0)
            piece, rest = _split_off(unit, room, sequences, measure)
            run.append(piece)
            room -= len(piece.members)
            if rest is not None:
                remaining.insert(0, rest)
                remaining.sort(key=lambda u: (-len(u.members), u.members[0]))
        runs.append(sorted(run, key=lambda u: u.members[0]))
    runs.sort(key=lambda run: (-_load(run), run[0].members[0]))
    return [u for run in runs for u in run]


def _exact_fill(units: list[_Unit], room: int) -> list[_Unit] | None:
    """Units whose sample counts add up to ``room`` (0/1 subset sum, earlier units first),
    or None."""
    reached_by: list[int | None] = [None] * (room + 1)  # the unit that first reached a sum
    reached_by[0] = -1
    for k, unit in enumerate(units):
        size = len(unit.members)
        for total in range(room, size - 1, -1):
            if reached_by[total] is None and reached_by[total - size] is not None:
                reached_by[total] = k
    if reached_by[room] is None:
        return None
    chosen, total = [], room
    while total:
        k = reached_by[total]
        chosen.append(units[k])
        total -= len(units[k].members)
    return chosen


def _groups_split(ranks: list[list[_Unit]]) -> int:
    holders: dict[int, set[int]] = {}
    for r, rank in enumerate(ranks):
        for unit in rank:
            if unit.group >= 0:
                holders.setdefault(unit.group, set()).add(r)
    return sum(len(h) > 1 for h in holders.values())


def _mini_batch_splits(ranks: list[list[_Unit]], mini_batch_size: int | None) -> int:
    if mini_batch_size is None:
        return 0
    split = set()
    for r, rank in enumerate(ranks):
        where: dict[int, set[int]] = {}
        position = 0
        for unit in rank:
            for _ in unit.members:
                if unit.group >= 0:
                    where.setdefault(unit.group, set()).add(position // mini_batch_size)
                position += 1
        split.update((r, g) for g, runs in where.items() if len(runs) > 1)
    return len({g for _, g in split})


def _room(rank: list[_Unit], capacity: int | None) -> int:
    return capacity - sum(len(u.members) for u in rank) if capacity is not None else 1 << 62


def _load(rank: list[_Unit]) -> float:
    return sum(u.cost for u in rank)


def _max_load(ranks: list[list[_Unit]]) -> float:
    return max(map(_load, ranks))
