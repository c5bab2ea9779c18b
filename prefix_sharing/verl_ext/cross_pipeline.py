"""verl's Megatron forward for a micro-batch of a cross group under pipeline parallelism.

verl runs its micro-batches through megatron's own 1F1B schedule: on every stage the forwards
and the backwards go in micro-batch order, a stage's forwards a few ahead of its backwards. A
prefix forward of its own in the group's first micro-batch (as :mod:`.cross_forward` runs it at
PP=1) would be backwarded there, before any reader has accumulated its dK/dV. So every stage
runs the group driver's stage forward
(:func:`prefix_sharing.megatron_ext.cross_pipeline.stage_forward`): the prefix rows ride in the
first micro-batch of the group without grad and in the last with grad, the middle ones read
the K/V leaves, and megatron's backward of the last one is the prefix's backward, once, on
every stage, after every other reader's. What is verl's own is the statistics it reads: on the
last stage the first micro-batch turns the prefix rows' logits into every sample's
prefix-position log-probs and entropy, kept as leaves (:class:`.cross_state.GroupState`); the
middle micro-batches read those leaves, and the last reads the statistics it recorded again
*through* them, so their gradients reach the prefix with its backward.

The prefix is computed twice (``cross_recomputed_tokens``); held across the group, per stage,
its layers' K/V leaves and their gradients (with MoE router statistics, its router logits too),
and no prefix activations. What runs under it is what the group driver's pipelined run
serves: one-level groups, TP with sequence parallelism, CP, activation recompute, sliding
windows, MoE router statistics and routing replay (each tested against verl's stock step,
``tests/verl_ext/test_cross_pipeline.py`` and ``test_cross_replay.py``).
"""

from __future__ import annotations

import torch

from ..config import PrefixSharingConfig
from .cross_state import GroupState, Readout, check_temperature
from .cross_groups import CrossPart
from .mcore import SharingMetrics, last_chunk_of_rank

__all__ = ["pipelined_cross_forward"]


def pipelined_cross_forward(model, part: CrossPart, sharing: PrefixSharingConfig,
                            readout: Readout, metrics: SharingMetrics | None,
                            routes: torch.Tensor | None,
                            device: torch.device) -> dict[str, torch.Tensor] | torch.Tensor:
    """This stage's forward of the micro-batch ``part`` (see the module doc): verl's output on
    the last stage (``readout``'s), the activation for the next stage before it. ``routes``:
    the routes its flat rows replay (verl's ``router_replay``), or None."""
    from megatron.core.utils import get_attr_wrapped_model, unwrap_model

    from ..megatron_ext.cross_pipeline import stage_forward
    from ..megatron_ext.cross_run import block_store
    from ..megatron_ext.cross_weave import leaves_of

    group, schedule = part.group, part.group.schedule
    # under interleaved stages each of a rank's model chunks runs every micro-batch, its own
    # layers' K/V in a store of its own
    chunk = getattr(unwrap_model(model), "vp_stage", None)
    if part.first:
        group.state = {**(group.state or {}), chunk: GroupState(
            block_store(schedule.blocks[0], device), None, None, readout.temperature)}
    state = group.state[chunk]
    check_temperature(state, readout.temperature)
    last_stage = get_attr_wrapped_model(model, "post_process")
    stage = stage_forward(model, state.prefix_kv, schedule, part.index, routes=routes,
                          backend=sharing.backend, temperature=readout.temperature,
                          device=device)
    if stage.prefix is not None and last_stage:  # every sample's prefix-position outputs
        state.recorded = recorded = readout.block(stage.prefix, stage.prefix_output[0])
        if part.first:  # recorded without grad: what the later micro-batches read
            state.leaves = leaves_of(recorded, requires_grad=torch.is_grad_enabled())
    if metrics is not None and last_chunk_of_rank(unwrap_model(model)):
        # the last micro-batch computes the prefix again
        metrics.add_tokens(part.tokens_total, part.tokens_computed + (
            schedule.prefix_len if part.last and not part.first else 0))
    if part.last:  # the last micro-batch's graph holds what its backward needs
        group.held_bytes += state.prefix_kv.held_bytes()  # every chunk's layers
        group.recomputed_tokens = 0 if part.first else schedule.prefix_len
        del group.state[chunk]
        group.state = group.state or None
    if not last_stage:  # hidden states [rows, 1, h]: both parts, for the next stage
        return stage.sent(last_stage=False)
    suffix = schedule.suffixes[part.index]
    tail_plan = suffix.tail_plan.to(device)
    tails = readout.tails(stage.output[0], tail_plan, stage.cp)
    heads = state.prefix_stats(list(suffix.members), part.last)
    return readout.verl_output(heads, tails, tail_plan)
