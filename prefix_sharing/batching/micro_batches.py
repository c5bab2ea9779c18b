"""Splits a batch into micro-batches that keep what is shared together, under a token budget.

A prefix is computed once only when its sharers sit in the same micro-batch. A split that
balances by total tokens and interleaves (verl's dynamic batch size does) scatters GRPO groups
and tree branches, and the sharing is lost. Here the unit of packing is a *sharing group*: the
samples of one ``uid`` when uids are given, else the sequences the planner links by a shared
prefix (``build_plan`` on the whole batch). Each micro-batch is charged the tokens it actually
computes (``plan.num_tokens_unique``), so under the same budget a shared micro-batch carries more
sequences than a plain one - that is what turns the FLOP ratio into throughput. The budget
bounds computed tokens; the load spread over the micro-batches is their computed cost
(:mod:`~prefix_sharing.batching.cost`: tokens plus attention), the work each one really does.

A group that alone exceeds the budget is cut in lexicographic order, between sub-trees
(at its shallowest branch points where that needs no more pieces), so deep shared prefixes stay
whole; every such group is counted in ``groups_split``. A single sequence longer than the
budget gets a micro-batch of its own and is listed in ``oversized``. With a fixed sample count
per micro-batch instead of a budget (verl without dynamic batch size),
:func:`split_fixed_micro_batches` packs the same groups into micro-batches of exactly that many
samples. The split is deterministic:
it depends on token ids, uids and the budget alone, so every rank that sees the same batch
builds the same one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

import numpy as np

from ..config import PrefixSharingConfig
from ..errors import InputError
from ..planner import TokenSequence
from .cost import CostModel, SubsetMeasure, check_batch, check_positive_int
from .groups import lexicographic_order, sharing_groups

__all__ = ["MicroBatchSplit", "split_fixed_micro_batches", "split_micro_batches"]

_Unit = tuple[int, float, list[int]]  # computed tokens, cost, members


@dataclasses.dataclass(frozen=True)
class MicroBatchSplit:
    """Micro-batches as index lists into the batch, and what the split cost in sharing.

    Attributes:
        micro_batches: per micro-batch the batch indices it holds, ascending.
        tokens_total: per micro-batch the tokens of its sequences (what the plain forward runs).
        tokens_computed: per micro-batch the tokens its plan computes (the budgeted figure).
        token_budget: the budget each micro-batch's computed tokens were kept under (0 for
            :func:`split_fixed_micro_batches`, which counts samples).
        num_groups: sharing groups in the batch.
        groups_split: groups whose members landed in more than one micro-batch.
        oversized: sequences longer than the budget on their own (each alone in a micro-batch).
    """

    micro_batches: tuple[tuple[int, ...], ...]
    tokens_total: tuple[int, ...]
    tokens_computed: tuple[int, ...]
    token_budget: int
    num_groups: int
    groups_split: int
    oversized: tuple[int, ...]

    @property
    def order(self) -> list[int]:
        """The batch indices in micro-batch order (the micro-batches concatenated)."""
        return [i for mb in self.micro_batches for i in mb]

    @property
    def inverse(self) -> list[int]:
        """``inverse[i]`` is where sample ``i`` sits in :attr:`order`: outputs concatenated in
        micro-batch order, indexed with it, come back in the batch's original order."""
        inverse = [0] * sum(len(mb) for mb in self.micro_batches)
        for position, index in enumerate(self.order):
            inverse[index] = position
        return inverse

    @property
    def token_ratio(self) -> float:
        """Tokens of the batch over tokens computed by all its micro-batches."""
        return sum(self.tokens_total) / sum(self.tokens_computed)

    def metrics(self, prefix: str = "prefix_sharing/") -> dict[str, float]:
        """The figures a trainer logs per step."""
        return {
            f"{prefix}token_ratio": self.token_ratio,
            f"{prefix}groups_split": float(self.groups_split),
            f"{prefix}num_micro_batches": float(len(self.micro_batches)),
            f"{prefix}max_tokens_computed": float(max(self.tokens_computed)),
        }


def split_micro_batches(
    sequences: Sequence[TokenSequence],
    token_budget: int,
    config: PrefixSharingConfig | None = None,
    *,
    uids: Sequence[Hashable] | None = None,
    prompt_lens: Sequence[int] | None = None,
    min_micro_batches: int = 1,
    cost_model: CostModel | None = None,
) -> MicroBatchSplit:
    """Packs the batch into as few micro-batches as the budget allows, groups kept together.

    Args:
        sequences: the batch, one 1-D token-id sequence per sample (as for ``build_plan``).
        token_budget: the most tokens one micro-batch may *compute* (after sharing; with
            ``mode="off"`` that is its total tokens, i.e. the plain budget).
        config: what is shared (``PrefixSharingConfig()`` when omitted).
        uids: one id per sample (verl's ``uid``); samples with the same uid form a group.
            Without uids, groups are the sequences the planner links by shared prefixes.
        prompt_lens: per-sample prompt length; needed with ``mode="prompt_only"`` (with uids).
        min_micro_batches: at least this many micro-batches (verl asks for the same count on
            every data-parallel rank, or a multiple of the virtual pipeline size); the load is
            spread over them, moving whole groups first and splitting groups only if needed.
        cost_model: how the load is weighed when it is spread (verl's ratio by default).

    Returns:
        The :class:`MicroBatchSplit`; micro-batches ordered by their first sample.
    """
    config = PrefixSharingConfig() if config is None else config
    n = len(sequences)
    _check_arguments(n, token_budget, min_micro_batches, uids, prompt_lens, config)
    measure = SubsetMeasure(sequences, config, uids, prompt_lens, cost_model)
    groups = sharing_groups(sequences, config, uids)

    units: list[_Unit] = []  # whole groups, or pieces of groups over the budget
    for members in groups:
        pieces = _cut(members, token_budget, sequences, measure)
        units += [_unit(piece, measure) for piece in pieces]
    bins = _pack(units, token_budget, min_micro_batches)
    _fill_empty(bins, sequences, measure)

    return _figures([[i for *_, members in b for i in members] for b in bins], groups,
                    sequences, measure, token_budget)


def split_fixed_micro_batches(
    sequences: Sequence[TokenSequence],
    size: int,
    config: PrefixSharingConfig | None = None,
    *,
    uids: Sequence[Hashable] | None = None,
    prompt_lens: Sequence[int] | None = None,
    reorder: bool = True,
) -> MicroBatchSplit:
    """Micro-batches of exactly ``size`` samples (verl's fixed micro-batch size), cutting as
    few sharing groups as the packing finds.

    verl cuts its batch into contiguous chunks of ``size``: a group that straddles a chunk
    boundary loses its sharing although another order of the samples would keep it whole.
    Here the groups (:func:`sharing_groups`, as in :func:`split_micro_batches`) are packed
    into ``len(sequences) // size`` micro-batches: a group larger than ``size`` fills whole
    micro-batches with runs of its lexicographic order (sub-trees stay together) and leaves
    its remainder; whole groups go best-fit, largest first, then the remainders; what fits
    nowhere whole fills the gaps, largest gap first, remainders of groups already cut before
    groups still whole. Bin packing is hard in general: this is a heuristic, exact when the
    group sizes divide ``size`` or ``size`` divides them. The batch's own contiguous chunks
    are returned instead unless the packing cuts fewer groups, or as many and computes fewer
    tokens: a batch whose order already keeps its groups is left as it is
    (:attr:`MicroBatchSplit.order` is then the identity). ``token_budget`` is 0: no token
    budget applies. ``reorder=False``: the contiguous chunks, for their figures (a caller
    that must keep the order still counts its cuts).

    Raises:
        InputError: when ``size`` does not divide the batch (verl asserts the same).
    """
    config = PrefixSharingConfig() if config is None else config
    n = len(sequences)
    check_batch("split_fixed_micro_batches", n, config, uids=uids, prompt_lens=prompt_lens)
    check_positive_int("size", size)
    if n % size:
        raise InputError(f"a micro-batch size of {size} does not divide the batch of {n} "
                         "sequences")
    measure = SubsetMeasure(sequences, config, uids, prompt_lens)
    groups = sharing_groups(sequences, config, uids)
    chunks = _figures([list(range(s, s + size)) for s in range(0, n, size)], groups,
                      sequences, measure, 0)
    if not reorder:
        return chunks
    packed = _figures(_pack_fixed(groups, size, n // size, sequences), groups, sequences,
                      measure, 0)
    better = (packed.groups_split, sum(packed.tokens_computed)) < (
        chunks.groups_split, sum(chunks.tokens_computed))
    return packed if better else chunks


def _pack_fixed(groups: list[list[int]], size: int, count: int,
                sequences: Sequence[TokenSequence]) -> list[list[int]]:
    """``count`` micro-batches of ``size`` samples holding every group (see
    :func:`split_fixed_micro_batches`)."""
    bins: list[list[int]] = []
    whole: list[list[int]] = []
    remainders: list[list[int]] = []
    for members in groups:
        if len(members) <= size:
            whole.append(members)
            continue
        ordered, _ = lexicographic_order(members, sequences)
        full = len(members) // size * size
        bins += [ordered[s:s + size] for s in range(0, full, size)]
        if full < len(members):
            remainders.append(ordered[full:])
    bins += [[] for _ in range(count - len(bins))]

    def best_fit(items: list[list[int]]) -> list[list[int]]:
        """Places each item whole where it leaves the least room; returns those that fit
        nowhere."""
        left = []
        for item in sorted(items, key=lambda g: (-len(g), g[0])):
            fits = [b for b in bins if size - len(b) >= len(item)]
            if fits:
                min(fits, key=lambda b: size - len(b)).extend(item)
            else:
                left.append(item)
        return left

    cut_remainders = best_fit(remainders)
    cut_groups = best_fit(whole)
    for item in cut_remainders + cut_groups:
        ordered, _ = lexicographic_order(item, sequences)
        while ordered:
            gap = max(bins, key=lambda b: size - len(b))
            take = size - len(gap)
            gap.extend(ordered[:take])
            ordered = ordered[take:]
    return bins


def _figures(bins: list[list[int]], groups: list[list[int]],
             sequences: Sequence[TokenSequence], measure: SubsetMeasure,
             token_budget: int) -> MicroBatchSplit:
    """The :class:`MicroBatchSplit` of ``bins`` (lists of batch indices): each sorted,
    ordered by first sample, with its tokens and the groups it cuts."""
    n = len(sequences)
    micro_batches = sorted(tuple(sorted(b)) for b in bins)
    where = np.empty(n, dtype=np.int64)
    for m, mb in enumerate(micro_batches):
        where[list(mb)] = m
    lengths = [len(s) for s in sequences]
    return MicroBatchSplit(
        micro_batches=tuple(micro_batches),
        tokens_total=tuple(sum(lengths[i] for i in mb) for mb in micro_batches),
        tokens_computed=tuple(measure(list(mb)) for mb in micro_batches),
        token_budget=token_budget,
        num_groups=len(groups),
        groups_split=sum(len(set(where[g].tolist())) > 1 for g in groups),
        oversized=tuple(i for i in range(n) if token_budget and lengths[i] > token_budget),
    )


def _check_arguments(n: int, token_budget: int, min_micro_batches: int,
                     uids: Sequence[Hashable] | None, prompt_lens: Sequence[int] | None,
                     config: PrefixSharingConfig) -> None:
    check_batch("split_micro_batches", n, config, uids=uids, prompt_lens=prompt_lens)
    for name, value in (("token_budget", token_budget), ("min_micro_batches", min_micro_batches)):
        check_positive_int(name, value)
    if min_micro_batches > n:
        raise InputError(
            f"min_micro_batches={min_micro_batches} exceeds the batch of {n} sequences")


def _unit(members: list[int], measure: SubsetMeasure) -> _Unit:
    tokens, weight = measure.measure(members)
    return tokens, weight, members


def _cut(members: list[int], token_budget: int, sequences: Sequence[TokenSequence],
         measure: SubsetMeasure) -> list[list[int]]:
    """The group whole if it fits; else pieces under the budget, cut between sub-trees.

    Members are taken in lexicographic token order
    (:func:`~prefix_sharing.batching.groups.lexicographic_order`), where every sub-tree is a
    contiguous run and the common-prefix length of two neighbours says how deep they part.
    Pieces are grown
    while they fit. Cutting an overflowing piece where the neighbours part earliest keeps the
    deepest shared prefixes whole; filling each piece to the budget needs the fewest pieces.
    The first is taken unless it needs more pieces than the second.
    """
    if len(members) == 1 or measure(members) <= token_budget:
        return [members]
    ordered, parting = lexicographic_order(members, sequences)
    at_branches = _grow(ordered, parting, token_budget, measure, at_branches=True)
    filled = _grow(ordered, parting, token_budget, measure, at_branches=False)
    return at_branches if len(at_branches) <= len(filled) else filled


def _grow(ordered: list[int], parting: list[int], token_budget: int, measure: SubsetMeasure,
          at_branches: bool) -> list[list[int]]:
    pieces, start = [], 0
    while start < len(ordered):
        end = start + 1
        while end < len(ordered) and measure(ordered[start:end + 1]) <= token_budget:
            end += 1
        if at_branches and end < len(ordered) and end - start > 1:
            shallowest = min(parting[start + 1:end + 1])
            end = max(c for c in range(start + 1, end + 1) if parting[c] == shallowest)
        pieces.append(sorted(ordered[start:end]))
        start = end
    return pieces


def _pack(units: list[_Unit], token_budget: int, min_micro_batches: int) -> list[list[_Unit]]:
    """Costliest unit first into the least-loaded micro-batch (by cost) whose computed tokens
    it fits in; a new one if none.

    Starts from as many micro-batches as the total tokens need (at least
    ``min_micro_batches``), so the load spreads evenly; a unit over the budget (one long
    sequence) takes one alone.
    """
    total = sum(tokens for tokens, _, _ in units)
    bins: list[list[_Unit]] = [
        [] for _ in range(max(min_micro_batches, min(len(units), math.ceil(total / token_budget))))
    ]
    tokens_in, loads = [0] * len(bins), [0.0] * len(bins)
    for unit in sorted(units, key=lambda u: (-u[1], u[2][0])):
        tokens, weight, _ = unit
        if tokens > token_budget:
            fits = [b for b in range(len(bins)) if not bins[b]]
        else:
            fits = [b for b in range(len(bins)) if tokens_in[b] + tokens <= token_budget]
        if not fits:
            bins.append([])
            tokens_in.append(0)
            loads.append(0.0)
            fits = [len(bins) - 1]
        best = min(fits, key=lambda b: (loads[b], b))
        bins[best].append(unit)
        tokens_in[best] += tokens
        loads[best] += weight
    used = [b for b in bins if b]  # units over the budget may have left starting ones empty
    return used + [[] for _ in range(min_micro_batches - len(used))]


def _fill_empty(bins: list[list[_Unit]], sequences: Sequence[TokenSequence],
                measure: SubsetMeasure) -> None:
    """Gives every empty micro-batch (asked for by ``min_micro_batches``) some samples.

    Moves the cheapest unit of the micro-batch with the most units; when every non-empty
    micro-batch holds a single unit, cuts the costliest multi-sample unit at its branch points
    into pieces (which the next round moves).
    """
    while any(not b for b in bins):
        crowded = max((b for b in bins if len(b) > 1), key=len, default=None)
        if crowded is not None:
            cheapest = min(crowded, key=lambda u: (u[1], u[2][0]))
            crowded.remove(cheapest)
            next(b for b in bins if not b).append(cheapest)
            continue
        holder = max((b for b in bins if b and len(b[0][2]) > 1),
                     key=lambda b: (b[0][1], -b[0][2][0]))
        tokens, _, members = holder.pop()
        pieces = _cut(members, max(1, tokens // 2), sequences, measure)
        if len(pieces) == 1:  # nothing to cut at (e.g. duplicates): halve in batch order
            pieces = [members[: len(members) // 2], members[len(members) // 2 :]]
        holder += [_unit(piece, measure) for piece in pieces]
