"""A group's shared blocks woven into its suffix micro-batches, each block's backward inside its
last reader's.

A loop that owns the micro-batches and runs each one's forward then its backward (verl's
engine: each micro-batch holds whole samples) runs a
:class:`~prefix_sharing.group_schedule.GroupSchedule`'s suffix micro-batches only; its blocks -
a one-level group's common prefix, a nested group's prefix chunks and sub-tree blocks - ride
in them, by one rule:

- **where a block runs**: its forward (recording its K/V per layer,
  :class:`~.prefix_kv.PrefixKV`, and what its members read out at its positions: log-probs and
  entropy, or a critic's values) runs at the start of the first suffix micro-batch after it in
  the schedule (``GroupSchedule.opening_blocks``: a one-level group's prefix at the start of
  its first), reading the blocks below it;
- **its last reader**: the last suffix whose samples it holds (:func:`closing_suffixes`).
  Every earlier reader, suffix or block, reads the block's leaves (detached copies that
  require grad), so its backward accumulates there; the last suffix reads the recorded
  tensors themselves with the leaves' gradients added on the way back (mode ``"read_last"``:
  :func:`~.prefix_kv.read_through`), and a block that reads it and closes in the same
  micro-batch reads them directly (mode ``"read_recorded"``). So that micro-batch's backward
  runs the blocks' backwards, each once, after all of its readers', **ordered by autograd's
  own dependencies**: the leaves' gradients it adds were complete before that backward began
  (every other reader's backward ran in an earlier micro-batch), and a block that reads it in
  the same backward is upstream of it in the graph. All before the optimizer step and any
  gradient reduction, inside the step's usual backwards.

**What is held.** A kept block keeps its graph from its forward to its last reader's backward
(its activations, plus its K/V leaves and their gradients): it is computed once. A
*checkpointed* block (``checkpointed=True``: verl's nested groups, whose prefix is too long to
keep) runs under a non-reentrant checkpoint (``torch.utils.checkpoint``), keeping only its K/V
and read-outs (the leaves share their storage) and their gradients between micro-batches; its
last reader's backward recomputes it when it reaches it, after that micro-batch's own nodes
(:attr:`BlockWeave.recomputed_tokens`). A forward-only step computes each block once, without
grad. Megatron's activation recompute runs inside a kept block (its replayed layers inject
the leaves' gradients, :class:`~.prefix_kv.PrefixKVPass`), not inside a checkpointed one (tried:
gradients 0.7-0.9 off).

**Its cost.** The last reader's backward runs several forwards' graphs in one autograd pass,
and autograd sums a weight's gradient contributions from all of them before accumulating it:
each weight used by several of those forwards holds a gradient-sized buffer through the pass.
Measured on the ``small`` preset's history workload (4 prefix chunks under a budget of 128):
the group driver's peak 199.5 MiB with this weave against 163.3 MiB with a backward step per
block, half of the difference the embedding's and output layer's gradients (16.7 MiB with
both frozen). So megatron's group driver, which owns its loop, gives each block a backward
step of its own (:mod:`.cross_pipeline`), and only verl's engine weaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..group_schedule import GroupSchedule
from .cross_run import PrefixPass, block_store
from .prefix_kv import PrefixKV, PrefixKVStack, read_through

__all__ = ["BlockWeave", "ReadOut", "Statistics", "closing_suffixes", "leaves_of",
           "select_statistics"]

# per-token read-outs at a block's positions, ``(members, length)`` each: log-probs and entropy
# (or None), or values and None
Statistics = tuple[torch.Tensor, torch.Tensor | None]
# a block's read-outs from its pass and the pass's output rows
ReadOut = Callable[[PrefixPass, torch.Tensor], Statistics]


def closing_suffixes(schedule: GroupSchedule) -> dict[int, int]:
    """``block -> the last suffix that reads it`` (every block is read by a suffix: its
    node's tails)."""
    close: dict[int, int] = {}
    for j, suffix in enumerate(schedule.suffixes):
        close.update(dict.fromkeys(suffix.reads, j))
    return close


def leaves_of(recorded: Statistics, requires_grad: bool | None = None) -> Statistics:
    """Detached copies of a block's recorded read-outs, requiring grad where they do (or as
    ``requires_grad`` says: read-outs recorded without grad that a later pass records again
    with it): what its readers but the last read, so their backwards accumulate there."""
    return tuple(None if t is None else t.detach().requires_grad_(
        t.requires_grad if requires_grad is None else requires_grad) for t in recorded)


def select_statistics(recorded: Statistics, leaves: Statistics, rows: torch.Tensor,
                      through: bool) -> Statistics:
    """The ``rows`` (samples) of a block's read-outs: its leaves, or for its last reader
    (``through``) the recorded tensors read through (the leaves' gradients added on the way
    back: :func:`~.prefix_kv.read_through`)."""
    return tuple(None if r is None else (read_through(r, leaf) if through else leaf)
                 .index_select(0, rows) for r, leaf in zip(recorded, leaves))


@dataclasses.dataclass
class _Block:
    """A live block: its K/V store and its members' read-outs at its positions, as recorded
    (in its graph) and as leaves."""

    kv: PrefixKV
    members: tuple[int, ...]
    recorded: Statistics
    leaves: Statistics


class BlockWeave:
    """One group's blocks while its suffix micro-batches run (see the module doc).

    Args:
        schedule: the group.
        read_out: what a block's members read out at its positions, from its pass's output.
        checkpointed: run each block under a checkpoint instead of keeping its graph.
        backend, temperature, device: as :class:`~.cross_run.PrefixPass` takes them.
    """

    def __init__(self, schedule: GroupSchedule, read_out: ReadOut, *, checkpointed: bool,
                 backend: str, temperature: float, device: torch.device) -> None:
        self.schedule = schedule
        self.read_out = read_out
        self.checkpointed = checkpointed
        self.backend, self.temperature, self.device = backend, temperature, device
        self.blocks: dict[int, _Block] = {}
        self.close = closing_suffixes(schedule)
        self.opens = schedule.opening_blocks()
        self.held_bytes = 0  # the most K/V leaf bytes (and gradients) live at once
        self.recomputed_tokens = 0  # block rows a backward computes again

    def open(self, model: torch.nn.Module, index: int) -> PrefixKVStack:
        """Runs the blocks opening at the start of suffix micro-batch ``index`` and returns
        what the suffix reads: the stack of its blocks' stores, each in its mode (the leaves,
        or read through by their last reader)."""
        for b in self.opens[index]:
            self.blocks[b] = self._run_block(model, b)
            if self.checkpointed and torch.is_grad_enabled():
                self.recomputed_tokens += self.schedule.blocks[b].length
        reads = self.schedule.suffixes[index].reads
        for r in reads:
            self.blocks[r].kv.mode = "read_last" if self.close[r] == index else "read"
        return PrefixKVStack([self.blocks[r].kv for r in reads])

    def heads(self, index: int, members: list[int]) -> Statistics:
        """``(len(members), depth)`` read-outs of suffix micro-batch ``index``'s samples
        ``members`` at the positions its blocks computed (the leaves, or the recorded tensors
        read through where it is their last reader)."""
        heads = []  # per block read, its read-outs of these samples
        for r in self.schedule.suffixes[index].reads:
            block = self.blocks[r]
            rows = torch.tensor([block.members.index(m) for m in members],
                                device=block.recorded[0].device)
            heads.append(select_statistics(block.recorded, block.leaves, rows,
                                           through=self.close[r] == index))
        return tuple(None if parts[0] is None else torch.cat(parts, dim=1)
                     for parts in zip(*heads))

    def done(self, index: int) -> None:
        """After suffix micro-batch ``index``'s forward: counts the K/V held, and drops the
        blocks it closes (its graph holds what its backward needs)."""
        self.held_bytes = max(self.held_bytes,
                              sum(block.kv.held_bytes() for block in self.blocks.values()))
        for r in self.schedule.suffixes[index].reads:
            if self.close[r] == index:
                del self.blocks[r]

    def _run_block(self, model: torch.nn.Module, b: int) -> _Block:
        """Block ``b``'s forward, recording its K/V, its graph kept or under a non-reentrant
        checkpoint: a block closing in the same micro-batch as one it reads reads that one's
        recorded tensors, else its leaves."""
        from torch.utils.checkpoint import checkpoint

        block = self.schedule.blocks[b]
        own = block_store(block, self.device)
        for r in block.reads:
            self.blocks[r].kv.mode = ("read_recorded" if self.close[r] == self.close[b]
                                      else "read")
        stack = PrefixKVStack([self.blocks[r].kv for r in block.reads], own)
        prefix = PrefixPass(self.schedule, stack, self.backend, self.temperature, self.device,
                            block=block)
        passes = [*prefix.params.prefix_kv.reads, prefix.params.prefix_kv.own]
        calls = 0

        def forward() -> Statistics:
            nonlocal calls
            calls += 1
            for view in passes:  # the checkpoint's recompute: the same computation, no new state
                view.replaying = calls > 1
            return self.read_out(prefix, prefix.forward(model))

        if self.checkpointed and torch.is_grad_enabled():  # no dropout: no RNG state to replay
            recorded = checkpoint(forward, use_reentrant=False, preserve_rng_state=False)
        else:
            recorded = forward()
        return _Block(own, block.members, recorded, leaves_of(recorded))
