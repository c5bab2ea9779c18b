"""The schedule of one group across micro-batches: its shared blocks, its suffix micro-batches
and the order they run in.

What :func:`~prefix_sharing.cross_micro_batch.plan_group` returns and every driver reads (the
group driver, the pipelined one, verl's engine); the figures a trainer logs per step come from
it too. Pure torch.
"""

from __future__ import annotations

import dataclasses

import torch

from .plan import SharingPlan

__all__ = ["SharedBlock", "SuffixMicroBatch", "GroupSchedule"]


@dataclasses.dataclass(frozen=True)
class SharedBlock:
    """A shared micro-batch: tokens ``start .. start + length - 1`` of every member, computed
    once (a chunk of a shared node).

    Attributes:
        members: the sequences (indices into the group) holding these tokens.
        start: the block's first position (its external rows: the blocks it reads, together).
        ids: ``(length,)`` its tokens.
        reads: the blocks whose K/V it reads, in row order (its ancestors, then the earlier
            chunks of its node).
        node: the shared node it is a chunk of (a node's chunks are consecutive blocks).
        plan: the model's plan (``start`` external rows, then its own, padded).
        stats_plan: a plan over ``length + N`` rows (its rows, then one placeholder row per
            member) whose sequences are ``s_i[start : start + length + 1]``: with the block's
            logits it gives every member's log-probs and entropy at its positions (the
            placeholder position is discarded).
        positions: ``(N * length,)`` int64, those positions in the group's packed order.
        routes: ``(length, moe_layers, topk)`` the recorded routes its rows replay (every
            member's, which agree: blocks are cut on tokens and routes), or None.
    """

    members: tuple[int, ...]
    start: int
    ids: torch.Tensor
    reads: tuple[int, ...]
    node: int
    plan: SharingPlan
    stats_plan: SharingPlan
    positions: torch.Tensor
    routes: torch.Tensor | None = None

    length = property(lambda self: self.ids.numel())
    end = property(lambda self: self.start + self.ids.numel())

    def scored_rows(self, output: torch.Tensor) -> torch.Tensor:
        """The rows ``stats_plan`` scores, from its pass's output rows (``[rows, ...]``, its
        own rows then its pad rows): its own rows, then one placeholder (zero) row per member,
        the position scoring whatever follows it, discarded (:meth:`scored_positions`)."""
        rows = output[: self.length]
        return torch.cat([rows, rows.new_zeros(len(self.members), *rows.shape[1:])])

    def scored_positions(self) -> torch.Tensor:
        """``(N * length,)`` the positions of ``stats_plan`` that are the block's rows of
        every member (member-major, as :attr:`positions`): all but the placeholders."""
        return (~self.stats_plan.is_last_token).nonzero()[:, 0]


@dataclasses.dataclass(frozen=True)
class SuffixMicroBatch:
    """One suffix micro-batch of a group.

    Attributes:
        members: indices (into the group's sequences) of the sequences whose tails it computes.
        plan: the model's plan (K/V rows = the ``reads`` blocks' rows, then its own rows).
        tail_plan: the tails' own plan over the same flat rows, for log-probs and entropy.
        token_positions: ``(sum of tail lengths,)`` int64, where each tail token sits in the
            group's packed order (sequences in given order): where its log-prob belongs.
        reads: the blocks whose K/V it reads, in row order (its members' shared ancestors).
        routes: its members' tails' recorded routes (``tail_plan``'s sequences, which it was
            planned with), or None.
    """

    members: tuple[int, ...]
    plan: SharingPlan
    tail_plan: SharingPlan
    token_positions: torch.Tensor
    reads: tuple[int, ...] = (0,)
    routes: tuple[torch.Tensor, ...] | None = None


@dataclasses.dataclass(frozen=True)
class GroupSchedule:
    """A group as shared blocks and suffix micro-batches, and the order they run in.

    Attributes:
        prefix_ids: ``(prefix_len,)`` the group's common prefix (its first node's blocks).
        suffixes: the suffix micro-batches, in run order.
        seq_lens: every sequence's length (given order).
        tokens_unique: tokens the whole group's single plan computes (``build_plan``).
        blocks: the shared blocks, in forward order (the first node's chunks first).
        steps: the run order: ``("forward", b)`` a block's forward (K/V recorded), ``("suffix",
            j)`` a suffix's forward and backward, ``("backward", b)`` a block's backward (after
            its last reader: blocks close in reverse, a sub-tree before the node above it).
        tokens_distinct: the group's distinct tokens (its prefix tree's size: every shared
            prefix once, whatever its length), what a schedule without recomputation computes.
    """

    prefix_ids: torch.Tensor
    suffixes: tuple[SuffixMicroBatch, ...]
    seq_lens: tuple[int, ...]
    tokens_unique: int
    blocks: tuple[SharedBlock, ...]
    steps: tuple[tuple[str, int], ...]
    tokens_distinct: int

    @property
    def prefix_len(self) -> int:
        return self.prefix_ids.numel()

    @property
    def prefix_stats_plan(self) -> SharingPlan:
        """The first block's stats plan (the whole common prefix's when it is one block)."""
        return self.blocks[0].stats_plan

    @property
    def prefix_positions(self) -> torch.Tensor:
        """The first block's positions (see :attr:`prefix_stats_plan`)."""
        return self.blocks[0].positions

    @property
    def one_level(self) -> bool:
        """One block (the common prefix) read by every suffix."""
        return len(self.blocks) == 1

    @property
    def num_micro_batches(self) -> int:
        """The shared blocks plus the suffix micro-batches."""
        return len(self.blocks) + len(self.suffixes)

    @property
    def tokens_computed(self) -> int:
        """Tokens the model computes over all micro-batches (each block once)."""
        return (sum(b.length for b in self.blocks)
                + sum(s.plan.num_tokens_unique for s in self.suffixes))

    @property
    def max_tokens_computed(self) -> int:
        """The largest micro-batch's computed tokens (at most the budget)."""
        return max([b.length for b in self.blocks]
                   + [s.plan.num_tokens_unique for s in self.suffixes])

    @property
    def held_rows(self) -> int:
        """Prefix rows whose K/V leaves (and gradients) are alive at once, at most: a block's
        stack of reads and itself while it is the deepest open one (blocks are freed after
        their backward, a closed sub-tree's before the next one opens)."""
        return max(b.end for b in self.blocks)

    num_tokens_total = property(lambda self: sum(self.seq_lens))

    def recomputed_tokens(self, recompute_prefix: bool = False) -> int:
        """Tokens computed more than once: a branch cut between suffix micro-batches
        (``one_level``) in each piece, and with ``recompute_prefix`` every block again."""
        again = sum(b.length for b in self.blocks) if recompute_prefix else 0
        return self.tokens_computed - self.tokens_distinct + again

    def metrics(self, prefix: str = "prefix_sharing/", *, recompute_prefix: bool = False
                ) -> dict[str, float]:
        """The figures a trainer logs per step (as :meth:`MicroBatchSplit.metrics
        <prefix_sharing.batching.MicroBatchSplit.metrics>` does for a split); the driver's
        :attr:`GroupRun.metrics <prefix_sharing.megatron_ext.cross_run.GroupRun>`
        adds the held bytes."""
        return {
            f"{prefix}num_micro_batches": float(self.num_micro_batches),
            f"{prefix}tokens_computed": float(self.tokens_computed),
            f"{prefix}token_ratio": self.num_tokens_total / self.tokens_computed,
            f"{prefix}prefix_recomputes_avoided": float(self.prefix_recomputes_avoided),
            f"{prefix}cross_recomputed_tokens": float(self.recomputed_tokens(recompute_prefix)),
        }

    def opening_blocks(self) -> list[tuple[int, ...]]:
        """Per suffix, the blocks whose forwards the steps place after the previous suffix:
        those a driver that runs each block in a suffix's micro-batch (verl's nested groups)
        runs at its start."""
        opened: list[tuple[int, ...]] = []
        pending: list[int] = []
        for kind, index in self.steps:
            if kind == "forward":
                pending.append(index)
            elif kind == "suffix":
                opened.append(tuple(pending))
                pending = []
        return opened

    def plans(self) -> list[SharingPlan]:
        """Every plan of the group, blocks' scoring first (for fingerprints)."""
        return [b.stats_plan for b in self.blocks] + [s.plan for s in self.suffixes]

    @property
    def prefix_recomputes_avoided(self) -> int:
        """Shared-node computations a split into independent micro-batches would add: per
        node, one per suffix micro-batch reading it beyond the first."""
        readers: dict[int, int] = {}
        for suffix in self.suffixes:
            for node in {self.blocks[b].node for b in suffix.reads}:
                readers[node] = readers.get(node, 0) + 1
        return sum(n - 1 for n in readers.values())
