"""Planning one group that is too large for one micro-batch: each shared prefix once.

A group (sequences sharing one long common prefix ``P``) whose computed tokens exceed the
micro-batch token budget is cut into *shared blocks* (micro-batches of shared tokens, computed
once) and *suffix micro-batches* (sets of the sequences' tails, at most ``token_budget``
computed tokens each). Every micro-batch reads the K/V of a stack of earlier blocks - its
ancestors in the group's prefix tree - as external rows in front of its own:

- ``P`` is the first shared node; longer than the budget it is computed in *chunks*, chunk
  ``j`` reading chunks ``< j`` (boundaries by the cost model: equal cost, so a later chunk,
  which attends more keys, is shorter);
- below ``P`` the tails are packed in lexicographic order into the fewest micro-batches, at
  equal cost (:mod:`.cross_packing`), a branch (same first token) kept whole when it fits; a branch that does not fit is a *sub-tree*:
  its own common part becomes a shared node (chunked in turn), read by its suffix micro-batches,
  itself reading the node above; recursively. So every prefix of every depth is computed once
  (``tokens_computed`` == the group's distinct tokens).

``one_level=True`` keeps the one-level schedule (``P`` in one micro-batch, a branch larger
than the budget cut between suffix micro-batches and computed in each): what verl's engine
runs when it fits, the prefix kept beside its tails (a group that does not fit nests there
too: :mod:`prefix_sharing.verl_ext.cross_groups`).

A micro-batch's :class:`~prefix_sharing.plan.SharingPlan` addresses *external rows plus its own
rows*: its K/V rows ``0 .. d-1`` are its stack of blocks' (read from the layers' kept K/V, in
stack order), rows ``d ..`` its own flat layout. Worked example, the group
``a = [5 6 7 8 9]``, ``b = [5 6 7 8 4]``, ``c = [5 6 7 2]`` (``P = [5 6 7]``, Lp = 3) in one
suffix micro-batch, every prefix shared (``b``'s tail ``[8 4]`` provides the ``8`` that ``a``'s
tail reuses)::

    input_ids       = [9 | 8 4 | 2]        own rows only (T_flat = 4)
    position_ids    = [4 | 3 4 | 3]        absolute positions (the tails start at Lp)
    cu_seqlens_q    = [0 1 3 4]
    cu_seqlens_kv   = [0 5 10 14]          each segment's keys: Lp prefix rows + its tail's
    kv_gather_index = [0 1 2 4 3 | 0 1 2 4 5 | 0 1 2 6]   into cat(prefix K/V, own K/V)
    kv_index        = the same here (every token of a, b, c, same addressing)
    prefix_lens     = (4, 3, 3)

With ``token_budget=2`` the same group becomes: chunk ``[5 6]`` (block 0), chunk ``[7]``
(block 1, reading block 0), then ``c``'s tail ``[2]`` (a suffix reading blocks 0, 1); the
branch ``[8 9] / [8 4]`` (4 tokens) is a sub-tree: its node ``[8]`` (block 2, reading 0, 1),
then the suffix ``[9 | 4]`` (reading 0, 1, 2). Backwards run in reverse: the suffixes', block
2's, block 1's, block 0's - each block's after its last reader, its leaves then holding every
reader's dK/dV.

A suffix is scored by ``tail_plan`` (the tails' own plan on its rows), a block by its
``stats_plan``. With recorded MoE routes (routing replay, ``routes=``) the tree is cut on
(token, route) pairs, as :func:`~prefix_sharing.planner.build_plan` shares: a route that
diverges inside token-identical prefixes ends a node there, and each block and suffix carries
its rows' routes. Pure torch; the driver is :mod:`prefix_sharing.megatron_ext.cross_micro_batch`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from .batching.cost import CostModel, computed_cost
from .config import PrefixSharingConfig
from .cross_packing import pack_at_equal_cost
from .group_schedule import GroupSchedule, SharedBlock, SuffixMicroBatch
from .plan import SharingPlan
from .planner import TokenSequence, build_plan, token_identity

__all__ = ["SharedBlock", "SuffixMicroBatch", "GroupSchedule", "common_prefix_len", "plan_group"]


def plan_group(
    sequences: Sequence[TokenSequence],
    token_budget: int,
    config: PrefixSharingConfig | None = None,
    *,
    pad_to_multiple_of: int = 1,
    one_level: bool = False,
    cost_model: CostModel | None = None,
    routes: Sequence[TokenSequence] | None = None,
) -> GroupSchedule:
    """Cuts one group into shared blocks and suffix micro-batches of at most ``token_budget``
    computed tokens each (see the module doc).

    The first shared node is the group's longest common prefix, one token short of the
    shortest sequence (every sequence keeps a tail of at least one token); a sub-tree's node
    likewise, within the sub-tree. Tails are taken in lexicographic order into the fewest
    micro-batches, at equal cost, a branch kept whole when it fits in one micro-batch.

    Args:
        sequences: the group's token ids, one unpadded 1-D sequence each (at least two).
        token_budget: computed tokens per micro-batch (every block and suffix).
        config: what to share inside a suffix micro-batch (``mode`` must not be ``"off"``).
        pad_to_multiple_of: pad each micro-batch's own rows to a multiple of this (sequence
            parallelism splits them over the tensor-parallel ranks); pad rows are not counted
            against the budget.
        one_level: the common prefix in one block, every suffix reading it alone, a branch
            over the budget cut (verl's engine, where it fits).
        cost_model: weighs attended keys against tokens where chunk and suffix boundaries go.
        routes: recorded MoE routes to replay, ``(L_i, moe_layers, topk)`` per sequence: a
            token's routes are part of its identity, as in :func:`build_plan`, so every
            shared node - the common prefix first - ends where the routes diverge, and each
            block and suffix carries the routes of its rows.

    Raises:
        ValueError: fewer than two sequences, no common prefix, sharing switched off; with
            ``one_level``, the prefix or one tail over the budget.
    """
    config = PrefixSharingConfig() if config is None else config
    if not config.enabled:
        raise ValueError("cross-micro-batch sharing needs a sharing config (mode is 'off')")
    if config.mode != "arbitrary_prefix":
        raise ValueError(
            f"cross-micro-batch sharing plans with mode='arbitrary_prefix'; got {config.mode!r}"
        )
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1).cpu() for s in sequences]
    if len(seqs) < 2:
        raise ValueError(f"a group needs at least two sequences; got {len(seqs)}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive; got {token_budget}")
    if routes is not None:
        routes = [torch.as_tensor(r).to("cpu", torch.int64) for r in routes]
    keys = seqs if routes is None else token_identity(seqs, routes)
    prefix_len = common_prefix_len(keys)
    if prefix_len < 1:
        raise ValueError("the group's sequences share no prefix (of at least one token, "
                         "leaving every sequence a tail, its routes agreeing)")
    if one_level and prefix_len > token_budget:
        raise ValueError(
            f"the group's common prefix ({prefix_len} tokens) exceeds token_budget="
            f"{token_budget}; with one_level=True it is computed in one micro-batch")
    builder = _Builder(seqs, keys, routes, token_budget, config, pad_to_multiple_of, one_level,
                       CostModel() if cost_model is None else cost_model)
    everyone = list(range(len(seqs)))
    reads, chunks = builder.shared(everyone, 0, (), prefix_len)
    builder.subtree(everyone, prefix_len, reads)
    builder.close(chunks)
    distinct = dataclasses.replace(config, min_prefix_len=1)
    return GroupSchedule(
        prefix_ids=seqs[0][:prefix_len],
        suffixes=tuple(builder.suffixes),
        seq_lens=tuple(s.numel() for s in seqs),
        tokens_unique=build_plan(seqs, config, routes=routes).num_tokens_unique,
        blocks=tuple(builder.blocks),
        steps=tuple(builder.steps),
        tokens_distinct=build_plan(seqs, distinct, routes=routes).num_tokens_unique,
    )


def common_prefix_len(seqs: list[torch.Tensor]) -> int:
    """The prefix :func:`plan_group` shares: the sequences' longest common prefix, at most one
    token short of the shortest (every sequence keeps a tail)."""
    limit = min(s.numel() for s in seqs) - 1
    first = seqs[0][:limit]
    same = torch.ones(limit, dtype=torch.bool)
    for s in seqs[1:]:
        same &= s[:limit] == first
    mismatch = (~same).nonzero()
    return int(mismatch[0]) if mismatch.numel() else limit


class _Builder:
    """Emits a group's blocks, suffixes and steps, depth first (see :func:`plan_group`).

    ``keys`` are what the tree is cut on: the tokens, or with ``routes`` one id per (token,
    routes) pair (:func:`~prefix_sharing.planner.token_identity`), ordered as the tokens."""

    def __init__(self, seqs: list[torch.Tensor], keys: list[torch.Tensor],
                 routes: list[torch.Tensor] | None, budget: int, config: PrefixSharingConfig,
                 pad: int, one_level: bool, cost_model: CostModel) -> None:
        self.seqs, self.keys, self.routes = seqs, keys, routes
        self.budget, self.config, self.pad = budget, config, pad
        self.one_level, self.cost_model = one_level, cost_model
        self.starts = [0]
        for s in seqs:
            self.starts.append(self.starts[-1] + s.numel())
        self.blocks: list[SharedBlock] = []
        self.suffixes: list[SuffixMicroBatch] = []
        self.steps: list[tuple[str, int]] = []
        self.nodes = 0

    def shared(self, members: list[int], depth: int, reads: tuple[int, ...],
               length: int) -> tuple[tuple[int, ...], list[int]]:
        """Emits the node ``[depth, depth + length)`` of ``members`` as chunk blocks; returns
        the stack its readers read and the chunks (to :meth:`close`)."""
        node, self.nodes = self.nodes, self.nodes + 1
        chunks: list[int] = []
        for a, b in self._chunks(depth, depth + length):
            self.blocks.append(self._block(members, a, b, reads + tuple(chunks), node))
            chunks.append(len(self.blocks) - 1)
            self.steps.append(("forward", chunks[-1]))
        return reads + tuple(chunks), chunks

    def close(self, chunks: list[int]) -> None:
        self.steps += [("backward", b) for b in reversed(chunks)]

    def subtree(self, members: list[int], depth: int, reads: tuple[int, ...]) -> None:
        """Schedules the tails after ``depth`` of ``members`` (who share ``[0, depth)``, held
        by the ``reads`` blocks)."""
        if not self.one_level and not self._fits(members, depth):
            length = self._common(members, depth)
            if length >= 1:
                stack, chunks = self.shared(members, depth, reads, length)
                self.subtree(members, depth + length, stack)
                self.close(chunks)
                return
        self._pack(members, depth, reads)

    def _pack(self, members: list[int], depth: int, reads: tuple[int, ...]) -> None:
        """Branches (same first token) in lexicographic order into micro-batches (the fewest,
        at equal cost: :mod:`~prefix_sharing.cross_packing`); a branch that fits nowhere is
        a sub-tree, or (``one_level``, or no shared part to give it) is cut tail by tail."""
        order = sorted(members, key=lambda i: self.keys[i][depth:].tolist())
        branches: list[list[int]] = []
        for i in order:
            if branches and int(self.keys[branches[-1][0]][depth]) == int(self.keys[i][depth]):
                branches[-1].append(i)
            else:
                branches.append([i])
        units: list[list[int]] = []  # packed together, between the sub-trees
        for branch in branches:
            n = len(branch)
            if self._fits(branch, depth):
                units.append(branch)
            elif not self.one_level and n < len(members):
                self._suffixes(units, depth, reads)
                units = []
                self.subtree(branch, depth, reads)
            elif not self.one_level and 0 < len(rest := self._longer(branch, depth)) < n:
                # sequences ending one token in keep the rest from sharing: they go on (that
                # token computed again for them), the rest is a sub-tree
                self._suffixes(units, depth, reads)
                units = [[i for i in branch if i not in rest]]
                self.subtree(rest, depth, reads)
            else:  # too large for one micro-batch, nothing to share it by: cut it
                for i in branch:
                    if not self._fits([i], depth):
                        raise ValueError(
                            f"sequence {i}'s tail after the common prefix "
                            f"({self.seqs[i].numel() - depth} tokens) exceeds token_budget="
                            f"{self.budget}")
                    units.append([i])
        self._suffixes(units, depth, reads)

    def _suffixes(self, units: list[list[int]], depth: int, reads: tuple[int, ...]) -> None:
        def cost(members: list[int]) -> float:  # its tails, each query attending the stack
            plan = build_plan([self.keys[i][depth:] for i in members], self.config)
            return (computed_cost(plan, self.cost_model)
                    + plan.num_tokens_unique * depth / self.cost_model.keys_per_token)

        for piece in pack_at_equal_cost(units, lambda m: self._fits(m, depth), cost):
            self._suffix(piece, depth, reads)

    def _longer(self, members: list[int], depth: int) -> list[int]:
        return [i for i in members if self.seqs[i].numel() - depth > 1]

    def _fits(self, members: list[int], depth: int) -> bool:
        tails = [self.keys[i][depth:] for i in members]
        return build_plan(tails, self.config).num_tokens_unique <= self.budget

    def _common(self, members: list[int], depth: int) -> int:
        """The members' common tokens after ``depth``, each keeping a tail."""
        return common_prefix_len([self.keys[i][depth:] for i in members]) if len(members) > 1 \
            else self.seqs[members[0]].numel() - depth - 1

    def _chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        """``[start, end)`` in the fewest chunks of at most the budget, their boundaries at
        equal cost (tokens + attended pairs / keys-per-token, every earlier key attended: a
        later chunk attends more keys, so it is shorter)."""
        def cost(b: int) -> float:  # of positions [start, b)
            n = b - start
            return n + (n * start + n * (n + 1) / 2) / self.cost_model.keys_per_token

        count = math.ceil((end - start) / self.budget)
        while True:
            bounds, a = [], start
            for j in range(1, count):
                target, b = cost(end) * j / count, min(a + self.budget, end - (count - j))
                while b > a + 1 and cost(b - 1) >= target:
                    b -= 1
                if b > a + 1 and target - cost(b - 1) < cost(b) - target:  # the nearer
                    b -= 1
                bounds.append((a, b))
                a = b
            if end - a <= self.budget:
                return bounds + [(a, end)]
            count += 1

    def _block(self, members: list[int], a: int, b: int, reads: tuple[int, ...],
               node: int) -> SharedBlock:
        members = sorted(members)
        ids = self.seqs[members[0]][a:b]
        own = build_plan([ids], PrefixSharingConfig(), pad_to_multiple_of=self.pad)
        return SharedBlock(
            members=tuple(members), start=a, ids=ids, reads=reads, node=node,
            plan=_with_external_prefix(own, a),
            stats_plan=_prefix_stats_plan([self.seqs[i][a:] for i in members], b - a),
            positions=torch.cat([torch.arange(a, b) + self.starts[i] for i in members]),
            routes=None if self.routes is None else self.routes[members[0]][a:b],
        )

    def _suffix(self, members: list[int], depth: int, reads: tuple[int, ...]) -> None:
        members = sorted(members)
        routes = None if self.routes is None else tuple(self.routes[i][depth:] for i in members)
        tail_plan = build_plan([self.seqs[i][depth:] for i in members], self.config,
                               pad_to_multiple_of=self.pad, routes=routes)
        self.suffixes.append(SuffixMicroBatch(
            members=tuple(members),
            plan=_with_external_prefix(tail_plan, depth),
            tail_plan=tail_plan,
            token_positions=torch.cat([torch.arange(depth, self.seqs[i].numel()) + self.starts[i]
                                       for i in members]),
            reads=reads,
            routes=routes,
        ))
        self.steps.append(("suffix", len(self.suffixes) - 1))


def _with_external_prefix(tail: SharingPlan, prefix_len: int) -> SharingPlan:
    """The tails' plan with ``prefix_len`` external rows in front of every key segment and
    every sequence (see the module example); a pad segment reads them too (its rows are
    never read)."""
    prefix_rows = torch.arange(prefix_len)
    kv_lens = torch.diff(tail.cu_seqlens_kv.to(torch.int64))
    gather = torch.split(tail.kv_gather_index + prefix_len, kv_lens.tolist())
    index = torch.split(tail.kv_index + prefix_len, list(tail.seq_lens))
    cu_kv = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kv_lens + prefix_len, 0)])
    return dataclasses.replace(
        tail,
        position_ids=tail.position_ids + prefix_len,
        cu_seqlens_kv=cu_kv.to(torch.int32),
        max_seqlen_kv=tail.max_seqlen_kv + prefix_len,
        cu_seqlens_kv_host=tuple(int(x) for x in cu_kv.tolist()),
        kv_gather_index=torch.cat([torch.cat([prefix_rows, g]) for g in gather]),
        kv_index=torch.cat([torch.cat([prefix_rows, x]) for x in index]),
        seq_lens=tuple(n + prefix_len for n in tail.seq_lens),
        prefix_lens=tuple(n + prefix_len for n in tail.prefix_lens),
        external_rows=prefix_len,  # the stored prefix, a key source of its own
    )


def _prefix_stats_plan(seqs: list[torch.Tensor], prefix_len: int) -> SharingPlan:
    """Plan over ``prefix_len + N`` rows for the prefix positions' log-probs (see
    :class:`GroupSchedule`); only its token-indexing fields are meaningful."""
    n = len(seqs)
    rows = torch.arange(prefix_len)
    input_ids = torch.cat([seqs[0][:prefix_len], torch.stack([s[prefix_len] for s in seqs])])
    kv_index = torch.cat([torch.cat([rows, torch.tensor([prefix_len + i])]) for i in range(n)])
    cu = torch.tensor([0, prefix_len + n], dtype=torch.int32)
    return SharingPlan(
        input_ids=input_ids,
        position_ids=torch.cat([rows, torch.full((n,), prefix_len)]),
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=prefix_len + n,
        max_seqlen_kv=prefix_len + n,
        cu_seqlens_q_host=(0, prefix_len + n),
        cu_seqlens_kv_host=(0, prefix_len + n),
        kv_gather_index=torch.arange(prefix_len + n),
        kv_index=kv_index,
        seq_lens=(prefix_len + 1,) * n,
        prefix_lens=(0,) + (prefix_len,) * (n - 1),
    )
