"""verl's Megatron forward for a group whose schedule nests: chunks and sub-tree blocks.

A group whose common prefix is too long to sit beside its tails in one micro-batch (over half
the budget: agent histories longer than ``max_token_len_per_gpu`` included), or whose
branches do not fit beside their shared part, is planned with
:func:`~prefix_sharing.cross_micro_batch.plan_group` at the full budget: its common prefix in
*chunks*, a branch that does not fit in a *sub-tree block* of its own, its tails in *suffix*
micro-batches. verl runs each suffix as one of its micro-batches (each holds whole samples:
verl's loss reads every sample's full row), forward then backward, in turn. So:

- **where a block runs**: its forward (recording its K/V per layer and its members'
  log-probs / entropy, or values, at its positions) runs at the start of the first suffix
  micro-batch after it in the schedule (``GroupSchedule.opening_blocks``), reading the blocks
  below it;
- **its last reader**: the last suffix whose samples it holds (:func:`closing_suffixes`).
  Every earlier reader, suffix or block, reads the block's leaves (detached copies that
  require grad), so its backward accumulates there; the last suffix reads the recorded tensors
  themselves with the leaves' gradients added on the way back (``prefix_kv.read_through``),
  and a block that reads it and closes in the same micro-batch reads them directly (mode
  ``"read_recorded"``): then that micro-batch's backward (megatron's, like every other) runs
  the blocks' backwards, each once, after all of its readers', **ordered by autograd's own
  dependencies**: the leaves' gradients it adds were complete before that backward began
  (every other reader's backward ran in an earlier micro-batch), and a block that reads it in
  the same backward is upstream of it in the graph. Everything happens before verl's optimizer step and megatron's gradient
  reduction, inside the step's usual backwards.
- **memory**: a block's forward runs under a non-reentrant checkpoint
  (``torch.utils.checkpoint``): it keeps no activations between micro-batches, only its K/V
  and statistics (the leaves share their storage) and their gradients; the last reader's
  backward recomputes it when it reaches it, after that micro-batch's own nodes (autograd
  runs later nodes first; ``prefix_sharing/cross_recomputed_tokens`` counts those rows). So no
  micro-batch holds more live activation rows than the budget (a tail, or one block while it
  is recomputed), and its tails are packed under the whole budget; what is held across
  micro-batches is the live blocks' K/V leaves and gradients (``prefix_sharing/
  cross_held_bytes``) and their statistics. Keeping the blocks' graphs instead, as the
  one-level path keeps its prefix's, would hold a prefix longer than the budget in activations
  across every micro-batch. A forward-only step (old log-probs) computes each block once,
  without grad; a training step twice.

Runs dense models at CP=1, PP=1 without megatron's activation recompute, with or without tensor
(and sequence) parallelism and sliding windows (what the tests compare with verl's stock step);
with other settings the engine plans such groups as before (the ordinary split, with a warning
and the ``cross_groups_unnested`` metric: :func:`nested_problem`). Megatron's recompute is a
known failure, not an untried one: its recomputed layers inside a block that is itself
recomputed in its last reader's backward gave gradients 0.7-0.9 off (the embedding's, on this
module's test batches) when tried. A group that fits one level keeps
:mod:`.cross_forward`'s schedule (its prefix kept, computed once).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ..group_schedule import GroupSchedule
from .cross_state import Readout, Statistics, leaves_of, select_statistics

if TYPE_CHECKING:
    from ..megatron_ext.prefix_kv import PrefixKVStack
    from .cross_groups import CrossPart

__all__ = ["NestedState", "closing_suffixes", "nested_problem",
           "open_micro_batch", "close_micro_batch"]


def closing_suffixes(schedule: GroupSchedule) -> dict[int, int]:
    """``block -> the last suffix that reads it`` (every block is read by a suffix: its
    node's tails)."""
    close: dict[int, int] = {}
    for j, suffix in enumerate(schedule.suffixes):
        close.update(dict.fromkeys(suffix.reads, j))
    return close


def nested_problem(tf_config: Any) -> str | None:
    """Why groups may not nest on a model with this megatron ``TransformerConfig``, or ``None``
    when they may: dense, at CP=1 and PP=1, without activation recompute (the settings the
    tests compare with verl's stock step, TP and sliding windows included; under pipeline
    parallelism a group runs one level, :mod:`.cross_pipeline`)."""
    from megatron.core import parallel_state

    untested = [f"{name}={value}" for name, value, plain in (
        ("recompute_granularity", getattr(tf_config, "recompute_granularity", None), None),
        ("num_moe_experts", getattr(tf_config, "num_moe_experts", None) or None, None),
        ("context_parallel_size", parallel_state.get_context_parallel_world_size(), 1),
        ("pipeline_model_parallel_size",
         getattr(tf_config, "pipeline_model_parallel_size", 1) or 1, 1),
    ) if value != plain]
    if not untested:
        return None
    return ("nested schedules run on dense models at CP=PP=1 without activation recompute; "
            "this model has " + ", ".join(untested))


@dataclasses.dataclass
class _Block:
    """A live block: its K/V store and its members' statistics at its positions,
    ``(members, length)`` each, as recorded (in its graph) and as leaves."""

    kv: Any
    members: tuple[int, ...]
    recorded: Statistics
    leaves: Statistics


@dataclasses.dataclass
class NestedState:
    """A nested group while it runs (:attr:`CrossGroup.state
    <.cross_groups.CrossGroup>`): its live blocks and what its micro-batches read out."""

    schedule: GroupSchedule
    readout: Readout
    blocks: dict[int, _Block] = dataclasses.field(default_factory=dict)
    close: dict[int, int] = dataclasses.field(init=False)
    opens: list[tuple[int, ...]] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.close = closing_suffixes(self.schedule)
        self.opens = self.schedule.opening_blocks()

    @property
    def temperature(self) -> float:
        """The group's sampling temperature (its first micro-batch's)."""
        return self.readout.temperature


def open_micro_batch(model: torch.nn.Module, part: CrossPart, backend: str, readout: Readout,
                     device: torch.device) -> PrefixKVStack:
    """Runs the blocks opening at the start of micro-batch ``part`` and returns what its
    suffix reads: the stack of its blocks' stores, each in its mode (the leaves, or read
    through by their last reader)."""
    from ..megatron_ext.prefix_kv import PrefixKVStack

    group = part.group
    if part.first:
        group.state = NestedState(group.schedule, readout)
    state: NestedState = group.state
    for b in state.opens[part.index]:
        state.blocks[b] = _run_block(model, state, b, backend, device)
        if torch.is_grad_enabled():  # its last reader's backward recomputes it
            group.recomputed_tokens += state.schedule.blocks[b].length
    reads = state.schedule.suffixes[part.index].reads
    for r in reads:
        state.blocks[r].kv.mode = "read_last" if state.close[r] == part.index else "read"
    return PrefixKVStack([state.blocks[r].kv for r in reads])


def close_micro_batch(part: CrossPart) -> Statistics:
    """``(n, depth)`` outputs (:meth:`.cross_state.Readout.block`) of micro-batch ``part``'s
    samples at the positions its blocks computed (the leaves, or the recorded tensors read
    through where it is their last reader); then drops the blocks it closes."""
    state: NestedState = part.group.state
    suffix = state.schedule.suffixes[part.index]
    heads = []  # per block read, its outputs of these samples
    for r in suffix.reads:
        block = state.blocks[r]
        rows = torch.tensor([block.members.index(m) for m in suffix.members],
                            device=block.recorded[0].device)
        heads.append(select_statistics(block.recorded, block.leaves, rows,
                                       through=state.close[r] == part.index))
    part.group.held_bytes = max(part.group.held_bytes,
                                sum(block.kv.held_bytes() for block in state.blocks.values()))
    for r in suffix.reads:
        if state.close[r] == part.index:
            del state.blocks[r]
    if part.last:
        part.group.state = None
    return tuple(None if parts[0] is None else torch.cat(parts, dim=1)
                 for parts in zip(*heads))


def _run_block(model: torch.nn.Module, state: NestedState, b: int, backend: str,
               device: torch.device) -> _Block:
    """Block ``b``'s forward, recording its K/V, under a non-reentrant checkpoint when it
    keeps a graph (see the module doc): a block closing in the same micro-batch as one it
    reads reads that one's recorded tensors, else its leaves."""
    from torch.utils.checkpoint import checkpoint

    from ..megatron_ext.cross_run import PrefixPass, block_store
    from ..megatron_ext.prefix_kv import PrefixKVStack

    block = state.schedule.blocks[b]
    own = block_store(block, device)
    for r in block.reads:
        state.blocks[r].kv.mode = "read_recorded" if state.close[r] == state.close[b] else "read"
    stack = PrefixKVStack([state.blocks[r].kv for r in block.reads], own)
    prefix = PrefixPass(state.schedule, stack, backend, state.temperature, device, block=block)
    passes = [*prefix.params.prefix_kv.reads, prefix.params.prefix_kv.own]
    calls = 0

    def forward() -> Statistics:
        nonlocal calls
        calls += 1
        for view in passes:  # the checkpoint's recompute: the same computation, no new state
            view.replaying = calls > 1
        return state.readout.block(prefix, prefix.forward(model))

    if torch.is_grad_enabled():  # no dropout runs (refused): no RNG state to replay
        recorded = checkpoint(forward, use_reentrant=False, preserve_rng_state=False)
    else:
        recorded = forward()
    return _Block(own, block.members, recorded, leaves_of(recorded))
