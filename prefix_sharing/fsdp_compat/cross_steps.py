"""A group run across micro-batches on a transformers model: its steps in a plain loop.

Where the caller owns a loop of micro-batches, each a forward and then a backward (verl's FSDP
engine; no pipeline stages), a group's steps run around its suffix micro-batches:
:class:`HFGroupSteps` runs the steps before suffix ``j`` when the caller asks for that
suffix's model keywords (:meth:`HFGroupSteps.suffix_kwargs`), and the rest when it closes the
group (:meth:`HFGroupSteps.finish`) - after the caller's backward of the suffix before them,
which is all a block's backward step needs (its last reader's backward has run). Each block
step is a model call of its own through the caller's ``call`` (its device and autocast), and
a backward step an ``autograd.backward`` of its own: what the steps do to the group's K/V and
per-token outputs, and the one gradient rule, are
:class:`~prefix_sharing.cross_blocks.GroupBlocks`'.

The stored K/V reach the model's attention through its keywords
(:func:`~prefix_sharing.fsdp_compat.model_kwargs` with ``prefix_kv``), which transformers hands
every layer's attention function; its gradient checkpointing replays a layer with the same
keywords, so the same :class:`~prefix_sharing.prefix_kv.PrefixKVPass` (a non-reentrant
recompute, which records nothing again).

A block's per-token outputs are read from the model's output rows (``read_out``):
:func:`block_log_probs` (the actor's: log-probs and entropy at every member's positions, each
member's own next token at the block's last one) or :func:`block_values` (the critic's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..cross_blocks import GroupBlocks, Statistics
from ..group_schedule import GroupSchedule, SharedBlock
from ..logprobs import token_log_probs
from ..plan import SharingPlan
from ..prefix_kv import PrefixKVStack
from ..row_split import RowSplit
from .forward import model_kwargs
from .ulysses import UlyssesSplit, ulysses_model_kwargs, ulysses_split, ulysses_token_stats

__all__ = ["HFGroupSteps", "block_log_probs", "block_values"]


class HFGroupSteps(GroupBlocks):
    """One group's steps on a transformers model in a plain loop (module doc).

    Args:
        schedule: the group.
        call: runs the model on a micro-batch's keywords (:func:`model_kwargs`) and returns its
            output rows, ``[rows, ...]``: logits (the actor), values (the critic).
        read_out: a block's members' per-token outputs from the block and its output rows.
        keep_graph: keep each block's graph from its forward step to its backward step (one
            level: the prefix fits beside its tails); else compute it again there.
        training: whether backward steps follow (else the blocks run once, without grad).
        backend: the attention kernel (``PrefixSharingConfig.backend``).
        device: where the plans and the blocks' stores live.
        ulysses: a Ulysses group: each model call runs this rank's rows of its plan (the
            schedule's plans padded to a multiple of the group's size), the attention the whole
            rows of this rank's heads, where the blocks' K/V are recorded and read
            (:mod:`.ulysses`); ``call`` then returns this rank's output rows.
    """

    def __init__(self, schedule: GroupSchedule, call: Callable[[dict], torch.Tensor],
                 read_out: Callable[[SharedBlock, torch.Tensor], Statistics], *,
                 keep_graph: bool, training: bool, backend: str, device: torch.device,
                 ulysses: torch.distributed.ProcessGroup | None = None) -> None:
        super().__init__(schedule, keep_graph=keep_graph, training=training, device=device)
        self.call, self.read_out, self.backend = call, read_out, backend
        self.ulysses = ulysses
        self._next = 0  # the next step to run

    def suffix_kwargs(self, index: int) -> dict[str, Any]:
        """Suffix micro-batch ``index``'s model keywords, its rows reading its blocks' K/V in
        place: after the steps before it have run."""
        until = self.steps.index(("suffix", index))
        if until < self._next:
            raise RuntimeError(f"suffix micro-batch {index} of a cross-micro-batch group runs "
                               "again: the group's micro-batches run once each, in order")
        self._run_steps(until)
        self._next = until + 1
        return self._inputs(self.schedule.suffixes[index].plan, self.suffix_stack(0, index))

    def _inputs(self, plan: SharingPlan, stack: PrefixKVStack) -> dict[str, Any]:
        """A micro-batch's model keywords (this rank's rows under Ulysses)."""
        plan = plan.to(self.device)
        inputs = model_kwargs(plan, self.backend, prefix_kv=stack)
        if self.ulysses is not None:
            inputs.update(ulysses_model_kwargs(plan, ulysses_split(plan, self.ulysses)))
        return inputs

    def finish(self) -> None:
        """The steps after the group's last suffix micro-batch (its blocks' backward steps),
        after that micro-batch's backward."""
        self._run_steps(len(self.steps))

    def _run_steps(self, until: int) -> None:
        """The block steps from the next one to step ``until`` (excluded)."""
        for kind, b in self.steps[self._next:until]:
            if kind == "suffix":
                raise RuntimeError(f"suffix micro-batch {b} of a cross-micro-batch group did "
                                   "not run: the group's micro-batches run once each, in order")
            self._block_step(kind, b)
            self._next += 1

    def _block_step(self, kind: str, b: int) -> None:
        if kind == "backward" and self.keep_graph:  # the kept graph's backward
            self.kept_term(0, b).backward()
            return
        block = self.schedule.blocks[b]
        inputs = self._inputs(block.plan, self.block_stack(0, b, kind))
        if kind == "forward":
            with torch.set_grad_enabled(self.keep_graph):
                self.recorded(0, b, self.read_out(block, self.call(inputs)))
            return
        output = self.call(inputs)  # with grad: the readers' K/V gradients injected
        leaves = self.release(0, b)
        self.recomputed_term(self.read_out(block, output), leaves).backward()


def block_log_probs(block: SharedBlock, logits: torch.Tensor, *, temperature: float,
                    with_entropy: bool,
                    ulysses: torch.distributed.ProcessGroup | None = None) -> Statistics:
    """``(members, length)`` log-probs (and entropy, or None) of ``block``'s members at its
    positions from its pass's ``[rows, vocab]`` logits: the log-prob at ``t`` scores token
    ``t + 1``, so the block's last position scores each member's own next token (its
    ``stats_plan``). Under a ``ulysses`` group ``logits`` are this rank's rows of the block's
    plan: the rank scores the positions its rows compute and every rank gets them all
    (:func:`~.ulysses.ulysses_token_stats`)."""
    plan = block.stats_plan.to(logits.device)
    if ulysses is None:
        stats = token_log_probs(block.scored_rows(logits), plan, temperature=temperature,
                                with_entropy=with_entropy)
    else:
        stats = ulysses_token_stats(logits, plan, _block_rows(block, plan, ulysses),
                                    temperature=temperature, with_entropy=with_entropy)
    keep = block.scored_positions().to(logits.device)
    shape = (len(block.members), block.length)
    return (stats.log_probs.index_select(0, keep).view(shape),
            stats.entropy.index_select(0, keep).view(shape) if with_entropy else None)


def block_values(block: SharedBlock, values: torch.Tensor) -> Statistics:
    """``(members, length)`` values of ``block``'s members at its positions from its pass's
    ``[rows]`` values: the row that computed a token gives every member its value."""
    return values[: block.length].expand(len(block.members), block.length), None


def _block_rows(block: SharedBlock, stats_plan: SharingPlan,
                group: torch.distributed.ProcessGroup) -> UlyssesSplit:
    """This rank's rows of the block's plan, and the positions of its stats plan they
    compute: the stats plan's flat rows are the block's (then its placeholders, which no rank
    scores)."""
    own = ulysses_split(block.plan, group).rows
    rows = stats_plan.kv_index
    stop = min(own.row_stop, block.length)
    positions = ((rows >= own.row_start) & (rows < stop)).nonzero()[:, 0]
    return UlyssesSplit(group, RowSplit(own.size, own.rank, own.row_start, own.row_stop,
                                        positions))
