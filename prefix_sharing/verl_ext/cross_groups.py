"""Which groups of a batch run across micro-batches, and as which micro-batches.

With ``cross_micro_batch`` on, a sharing group whose computed tokens exceed the micro-batch
budget (verl's ``max_token_len_per_gpu``) is not cut into pieces that each recompute its prefix
(:func:`prefix_sharing.batching.split_micro_batches`). It becomes a :class:`CrossGroup`: its
common prefix computed once and its tails in consecutive micro-batches
(:func:`prefix_sharing.cross_micro_batch.plan_group`), which the engine runs in order
(:mod:`.cross_schedule`). Each of those micro-batches holds whole samples (verl's loss reads
every sample's full row), the samples whose tails it computes.

The budget counts the prefix too: the prefix's rows stay alive (its activations and K/V) while
every tail micro-batch runs, so the tails are packed under ``budget - prefix_len``. A group
that cannot be planned so (a tail too long, a prefix over half the budget) *nests*
(``nested``): its common prefix in chunks, its branches that do not fit in sub-tree blocks,
its tails under the whole budget, the blocks computed again in their backward steps instead of
kept (:mod:`.cross_schedule`). An engine that computes every block again in its backward
step gains nothing from keeping the prefix beside its tails: there every group nests
(``keep_prefix=False``: verl's FSDP engine). A group is left to the ordinary split
when its common prefix is shorter than ``min_prefix_len``, or when it cannot be planned either
way.

Pure torch: no verl, no megatron; every rank that sees the same batch plans the same groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..batching import sharing_groups
from ..config import PrefixSharingConfig
from ..cross_micro_batch import GroupSchedule, common_prefix_len, plan_group
from ..planner import TokenSequence, build_plan, token_identity

__all__ = ["CrossGroup", "CrossPart", "plan_cross_groups"]


@dataclasses.dataclass(eq=False)
class CrossGroup:
    """One group run across consecutive micro-batches.

    Attributes:
        members: the group's batch indices, ascending (``schedule``'s sequence order).
        schedule: its prefix and tail micro-batches.
        token_budget: the budget its micro-batches were planned under (prefix included).
        state: while the group runs, its executor
            (:class:`~prefix_sharing.megatron_ext.cross_steps.GroupSteps`: its live blocks'
            K/V and per-token outputs); ``None`` before and after.
        held_bytes: after its last micro-batch, the bytes of prefix K/V leaves and their
            gradients it held across its micro-batches (this rank's K/V heads).
        nested: whether it runs as a nested schedule (its blocks computed again in their
            backward steps; even with one block, its tails were packed under the whole
            budget), or one level (the prefix kept at PP=1): :mod:`.cross_schedule`.
        recomputed_tokens: block rows its backward steps computed again (a nested
            schedule's blocks, and every block under pipeline parallelism).
    """

    members: tuple[int, ...]
    schedule: GroupSchedule
    token_budget: int
    state: Any = None
    held_bytes: int = 0
    nested: bool = False
    recomputed_tokens: int = 0

    def parts(self) -> list[CrossPart]:
        return [CrossPart(self, k) for k in range(len(self.schedule.suffixes))]


@dataclasses.dataclass(frozen=True, eq=False)
class CrossPart:
    """The ``index``-th micro-batch of a :class:`CrossGroup` (its ``index``-th suffix)."""

    group: CrossGroup
    index: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == len(self.group.schedule.suffixes) - 1

    @property
    def batch_indices(self) -> list[int]:
        """The batch indices of the samples whose tails this micro-batch computes, ascending."""
        return [self.group.members[m] for m in self.group.schedule.suffixes[self.index].members]

    @property
    def tokens_total(self) -> int:
        """Tokens of its samples (what the plain forward would run for them)."""
        return sum(self.group.schedule.seq_lens[m]
                   for m in self.group.schedule.suffixes[self.index].members)

    @property
    def tokens_computed(self) -> int:
        """Tokens the model runs for it: its tails' plan, and the blocks whose forward steps
        run before it (the prefix before the first)."""
        schedule = self.group.schedule
        return schedule.suffixes[self.index].plan.num_tokens_unique + sum(
            schedule.blocks[b].length for b in schedule.opening_blocks()[self.index])


def plan_cross_groups(
    sequences: Sequence[TokenSequence],
    token_budget: int,
    config: PrefixSharingConfig,
    uids: Sequence[Hashable] | None = None,
    pad_to_multiple_of: int = 1,
    routes: Sequence[TokenSequence] | None = None,
    nested: bool = False,
    keep_prefix: bool = True,
) -> tuple[list[CrossGroup], list[int]]:
    """The groups of the batch that run across micro-batches, and the other samples' indices.

    Nothing crosses micro-batches unless ``config.cross_micro_batch`` (then every index is
    returned as ordinary). Groups are :func:`~prefix_sharing.batching.sharing_groups` (by
    ``uids`` when given). ``pad_to_multiple_of``: each micro-batch's rows are padded to it
    (the tensor- times context-parallel size: CP splits them over its ranks, sequence
    parallelism each slice over TP; the prefix micro-batch is padded the same way where it
    runs). ``routes``: the samples' recorded MoE routes to replay (verl's ``router_replay``),
    part of a token's identity: a group's prefix ends where its samples' routes diverge, and
    each of its micro-batches replays its rows'. ``nested``: a group that does not fit one
    level may nest (see the module doc). ``keep_prefix=False``: the engine computes every
    block again in its backward step instead of keeping its graph (verl's FSDP engine), so
    nothing is gained by keeping the prefix beside its tails: every group nests (needs
    ``nested``), its tails packed under the whole budget.
    """
    if not config.cross_micro_batch:
        return [], list(range(len(sequences)))
    cross, rest = [], []
    for members in sharing_groups(sequences, config, uids):
        planned = _schedule([sequences[i] for i in members], token_budget, config,
                            pad_to_multiple_of,
                            None if routes is None else [routes[i] for i in members], nested,
                            keep_prefix)
        if planned is None:
            rest += members
        else:
            cross.append(CrossGroup(tuple(members), planned[0], token_budget,
                                    nested=planned[1]))
    return cross, sorted(rest)


def _schedule(sequences: list[TokenSequence], token_budget: int,
              config: PrefixSharingConfig, pad_to_multiple_of: int = 1,
              routes: list[TokenSequence] | None = None,
              nested: bool = False, keep_prefix: bool = True) -> tuple[GroupSchedule, bool] | None:
    """The group's schedule under ``token_budget`` (prefix included) and whether it nests, or
    ``None`` when it fits one micro-batch or is left to the ordinary split (see the module
    doc)."""
    if len(sequences) < 2 or build_plan(sequences, config,
                                        routes=routes).num_tokens_unique <= token_budget:
        return None
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1).cpu() for s in sequences]
    prefix_len = common_prefix_len(seqs if routes is None else token_identity(seqs, routes))
    if prefix_len < config.min_prefix_len:
        return None
    if keep_prefix and 2 * prefix_len <= token_budget:
        try:
            return plan_group(seqs, token_budget - prefix_len, config, one_level=True,
                              pad_to_multiple_of=pad_to_multiple_of, routes=routes), False
        except ValueError:  # a tail longer than the budget left beside the prefix
            pass
    if not nested:
        return None
    try:
        return plan_group(seqs, token_budget, config, pad_to_multiple_of=pad_to_multiple_of,
                          routes=routes), True
    except ValueError:  # a tail longer than the budget with nothing to share it by
        return None
