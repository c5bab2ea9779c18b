"""verl's Megatron forward for one micro-batch of a group that runs across micro-batches.

A :class:`~.cross_groups.CrossGroup` is run as consecutive verl micro-batches (its schedule's
suffix micro-batches), each holding the samples whose tails it computes: verl's loss reads
every sample's full row. verl's loop (megatron's ``forward_backward_no_pipelining``) runs each
micro-batch's forward then its backward, in turn, so the schedule's shared blocks - a
one-level group's common prefix; a nested group's prefix chunks and sub-tree blocks - are
woven into them, by one rule:

- **where a block runs**: its forward (recording its K/V per layer,
  :class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKV`, and its members' log-probs /
  entropy, or values, at its positions) runs at the start of the first suffix micro-batch
  after it in the schedule (``GroupSchedule.opening_blocks``: a one-level group's prefix at
  the start of its first), reading the blocks below it;
- **its last reader**: the last suffix whose samples it holds (:func:`closing_suffixes`).
  Every earlier reader, suffix or block, reads the block's leaves (detached copies that
  require grad), so its backward accumulates there; the last suffix reads the recorded
  tensors themselves with the leaves' gradients added on the way back (mode ``"read_last"``:
  :func:`~prefix_sharing.megatron_ext.prefix_kv.read_through`), and a block that reads it
  and closes in the same micro-batch reads them directly (mode ``"read_recorded"``). So that
  micro-batch's backward (megatron's, like every other) runs the blocks' backwards, each once,
  after all of its readers', **ordered by autograd's own dependencies**: the leaves'
  gradients it adds were complete before that backward began (every other reader's backward
  ran in an earlier micro-batch), and a block that reads it in the same backward is upstream
  of it in the graph. Everything happens before verl's optimizer step and megatron's
  gradient reduction, inside the step's usual backwards.

**What is held.** A one-level group keeps its prefix's graph from its first micro-batch to
its last (its activations, plus its K/V leaves and their gradients): the prefix is computed
once, and its tails were packed under the budget less the prefix. A nested group's prefix is
too long for that (over half the budget: agent histories longer than
``max_token_len_per_gpu`` included), or its branches do not fit beside their shared part: its
blocks run under a non-reentrant checkpoint (``torch.utils.checkpoint``), keeping only their
K/V and statistics (the leaves share their storage) and their gradients between micro-batches;
the last reader's backward recomputes a block when it reaches it, after that micro-batch's own
nodes (``prefix_sharing/cross_recomputed_tokens`` counts those rows). So no micro-batch holds
more live activation rows than the budget, and its tails are packed under the whole budget. A
forward-only step (old log-probs) computes each block once, without grad.

Each sample's log-probs and entropy come back as verl expects them (the value at ``t`` scores
token ``t + 1``, the last position 0), so verl's loss runs unchanged on each micro-batch; the
critic's values likewise (:class:`.cross_state.Readout`).

**Settings** (each tested against verl's stock step). Under activation recompute (full or
selective) a kept prefix's recomputed layers keep only their inputs, and their replay - inside
the last micro-batch's backward, in the prefix's own ``record`` mode
(:class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKVPass`) - injects every micro-batch's
dK/dV, the last one's included, which then reads the leaves too. Under tensor parallelism each
micro-batch's rows, a block's included, are padded to the tensor-parallel size (sequence
parallelism splits them over its ranks; a block's pad rows are not kept). Under context
parallelism (with or without TP and activation recompute, dense or MoE, as in the group
driver) each micro-batch, the prefix's included, is split over the CP ranks and padded to
their count, the prefix's K/V recorded gathered (:mod:`~prefix_sharing.megatron_ext.
cross_context_parallel`); every rank returns every sample whole, as the shared forward does
under CP. Sliding windows run as in the group driver. MoE router statistics are each cross
micro-batch's plain micro-batch's, as in the group driver, under context and sequence
parallelism too (where verl's own step differs by counting the rows it pads each sample with
for TP and CP, as in one micro-batch: ``tests/verl_ext/test_cross_moe_sequence_parallel.py``;
equal where no sample is padded). Routing replay (verl's ``router_replay``): the group was
cut on tokens and routes at the split (:mod:`.cross_groups`), a block replays its rows' routes
and every micro-batch its tails' (:func:`replayed_routes`, checked against the micro-batch's
own); ``R2``'s recording forward takes the ordinary split. Nested groups run on dense models
at CP=1 without activation recompute (:func:`nested_problem`; elsewhere the engine plans such
a group as before, with a warning and the ``cross_groups_unnested`` metric): megatron's
recompute inside a block that is itself recomputed in its last reader's backward gave
gradients 0.7-0.9 off (the embedding's) when tried. Under pipeline parallelism, interleaved
stages included, a one-level prefix rides in the group's first and last micro-batch on every
stage instead (:mod:`.cross_pipeline`; a group that would nest takes the ordinary split).
Each refusal raises one error naming the setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import PrefixSharingConfig
from ..group_schedule import GroupSchedule
from .cross_groups import CrossPart
from .cross_state import Readout, Statistics, check_temperature, leaves_of, select_statistics
from .mcore import SharingMetrics, check_text_only, micro_batch_temperature

__all__ = ["closing_suffixes", "cross_forward", "nested_problem", "pipelined"]


def cross_forward(
    model,
    input_ids: torch.Tensor,
    multi_modal_inputs: dict,
    logits_processor=None,
    logits_processor_args: dict | None = None,
    value_model: bool = False,
    vision_model: bool = False,
    *,
    part: CrossPart,
    sharing: PrefixSharingConfig,
    calculate_entropy: bool,
    metrics: SharingMetrics | None = None,
    replay_routes: list[torch.Tensor] | None = None,
    **_verl_kwargs: Any,
) -> dict[str, torch.Tensor] | torch.Tensor:
    """verl's ``gptmodel_forward_model_engine`` for the micro-batch ``part`` of a cross group
    (see the module doc); arguments as :func:`.mcore.shared_forward` takes them: the actor's
    log-probs (and entropy), or with ``value_model`` the critic's values."""
    from ..megatron_ext import check_sharing_model
    from ..megatron_ext.cross_context_parallel import model_inputs, slice_micro_batch
    from ..megatron_ext.packed_seq import PlanPackedSeqParams

    check_text_only(vision_model, multi_modal_inputs)
    check_sharing_model(model)
    suffix = part.group.schedule.suffixes[part.index]
    if input_ids.size(0) != len(suffix.members):
        raise ValueError(f"micro-batch {part.index} of a cross-micro-batch group holds "
                         f"{input_ids.size(0)} samples; its plan has {len(suffix.members)}")
    temperature = micro_batch_temperature((logits_processor_args or {}).get("temperature"))
    readout = Readout(value_model, temperature, calculate_entropy)
    device = input_ids.device
    routes = replayed_routes(model, part, replay_routes, device)
    if pipelined(model):  # every stage carries the prefix rows in the first and last
        from .cross_pipeline import pipelined_cross_forward

        return pipelined_cross_forward(model, part, sharing, readout, metrics, routes, device)
    prefix_kv = _open_micro_batch(model, part, sharing.backend, readout, device)
    cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat, device)
    plan, tail_plan = suffix.plan.to(device), suffix.tail_plan.to(device)
    params = PlanPackedSeqParams.from_plan(plan, sharing.backend, cp=cp and cp.attention,
                                           prefix_kv=prefix_kv, routes=routes)
    input_ids, position_ids = model_inputs(plan, cp)  # under CP this rank's rows
    output = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                   packed_seq_params=params)[0]  # [rows, V] logits, or [rows, 1] values
    tails = readout.tails(output, tail_plan, cp)
    heads = _close_micro_batch(part)
    if metrics is not None:
        metrics.add_tokens(part.tokens_total, part.tokens_computed)
    return readout.verl_output(heads, tails, tail_plan)


def pipelined(model) -> bool:
    """Whether ``model`` is one stage of several (pipeline parallelism)."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model, "config").pipeline_model_parallel_size > 1


def replayed_routes(model, part: CrossPart, replay_routes: list | None,
                    device: torch.device) -> torch.Tensor | None:
    """The routes the micro-batch ``part``'s flat rows replay (verl's ``router_replay``):
    its tails' as the group was planned with them (:func:`.routing_replay.split_routes`),
    after checking they are the micro-batch's own; None without replay."""
    from megatron.core.utils import unwrap_model

    from ..megatron_ext.cross_run import suffix_routes
    from .routing_replay import check_padded_statistics

    schedule = part.group.schedule
    suffix = schedule.suffixes[part.index]
    tails = suffix.routes
    if replay_routes is None and tails is None:
        return None
    if replay_routes is None or tails is None or not all(
            torch.equal(r[schedule.prefix_len:].cpu(), t)
            for r, t in zip(replay_routes, tails, strict=True)):
        raise ValueError(f"micro-batch {part.index} of a cross-micro-batch group replays routes "
                         "other than those its group was planned with")
    check_padded_statistics(unwrap_model(model))
    return suffix_routes(suffix, device)


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
class _GroupState:
    """A group while it runs (:attr:`CrossGroup.state <.cross_groups.CrossGroup>`): its live
    blocks and what its micro-batches read out."""

    schedule: GroupSchedule
    readout: Readout
    checkpointed: bool  # nested: each block recomputed by its last reader's backward
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


def _open_micro_batch(model: torch.nn.Module, part: CrossPart, backend: str, readout: Readout,
                      device: torch.device):
    """Runs the blocks opening at the start of micro-batch ``part`` and returns what its
    suffix reads: the stack of its blocks' stores, each in its mode (the leaves, or read
    through by their last reader)."""
    from ..megatron_ext.prefix_kv import PrefixKVStack

    group = part.group
    if part.first:
        group.state = _GroupState(group.schedule, readout,
                                  checkpointed=group.nested and torch.is_grad_enabled())
    state: _GroupState = group.state
    check_temperature(state, readout.temperature)
    for b in state.opens[part.index]:
        state.blocks[b] = _run_block(model, state, b, backend, device)
        if state.checkpointed:  # its last reader's backward recomputes it
            group.recomputed_tokens += state.schedule.blocks[b].length
    reads = state.schedule.suffixes[part.index].reads
    for r in reads:
        state.blocks[r].kv.mode = "read_last" if state.close[r] == part.index else "read"
    return PrefixKVStack([state.blocks[r].kv for r in reads])


def _close_micro_batch(part: CrossPart) -> Statistics:
    """``(n, depth)`` outputs (:meth:`.cross_state.Readout.block`) of micro-batch ``part``'s
    samples at the positions its blocks computed (the leaves, or the recorded tensors read
    through where it is their last reader); then drops the blocks it closes."""
    state: _GroupState = part.group.state
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
    if part.last:  # the last micro-batch's graph holds what its backward needs
        part.group.state = None
    return tuple(None if parts[0] is None else torch.cat(parts, dim=1)
                 for parts in zip(*heads))


def _run_block(model: torch.nn.Module, state: _GroupState, b: int, backend: str,
               device: torch.device) -> _Block:
    """Block ``b``'s forward, recording its K/V, its graph kept or (nested) under a
    non-reentrant checkpoint (see the module doc): a block closing in the same micro-batch as
    one it reads reads that one's recorded tensors, else its leaves."""
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

    if state.checkpointed:  # no dropout runs (refused): no RNG state to replay
        recorded = checkpoint(forward, use_reentrant=False, preserve_rng_state=False)
    else:
        recorded = forward()
    return _Block(own, block.members, recorded, leaves_of(recorded))
