"""verl's Megatron forward for one micro-batch of a group that runs across micro-batches.

A :class:`~.cross_groups.CrossGroup` is run as consecutive verl micro-batches, each holding
the samples whose tails it computes. verl's loop (megatron's ``forward_backward_no_pipelining``)
runs forward then backward per micro-batch, so the prefix is woven into them:

- the group's **first** micro-batch runs the prefix first (identity plan, its K/V recorded per
  layer: :class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKV`) and scores every sample's
  prefix positions ``0 .. Lp-1`` (the last prefix row predicts each sample's first own token).
  Those log-probs / entropy and the K/V are kept in the prefix's graph, and as leaves;
- every micro-batch but the last reads the leaves: its attention over ``cat(prefix K/V, own)``
  and its samples' rows ``cat(prefix statistics, own)``, so its backward accumulates the
  prefix's gradients in the leaves' ``.grad`` and stops there;
- the **last** micro-batch reads the recorded tensors themselves (``read_through``: the leaves'
  accumulated gradients are added on the way back), so its backward - megatron's, like every
  other - runs the prefix's backward once, with every micro-batch's gradient, inside the same
  pass. Everything happens before verl's optimizer step and megatron's gradient reduction.

A group that does not fit one level (a prefix over half the budget, a tail over the rest)
nests instead - its prefix in chunks, its branches in sub-tree blocks - where the engine's model
allows it: :mod:`.cross_nested` runs those blocks around the same suffix forward.

Each sample's log-probs and entropy come back as verl expects them (the value at ``t`` scores
token ``t + 1``, the last position 0), so verl's loss runs unchanged on each micro-batch; the
critic's values likewise (:class:`.cross_state.Readout`).
Held across the group: the prefix's activations (its graph) and its K/V leaves with their
gradients. Under activation recompute (full or selective) the prefix's recomputed layers keep
only their inputs, and their replay - inside the last micro-batch's backward, in the prefix's
own ``record`` mode (:class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKVPass`) - injects
every micro-batch's dK/dV, the last one's included, which then reads the leaves too. Under
tensor parallelism each micro-batch's rows, the prefix's included, are padded to the
tensor-parallel size (sequence parallelism splits them over its ranks; the prefix's pad rows are
not kept). Under context parallelism (with or without TP and activation recompute, dense or MoE,
as in the group driver) each micro-batch, the prefix's included, is split over the CP ranks and
padded to their count, the prefix's K/V recorded gathered (:mod:`~prefix_sharing.megatron_ext.
cross_context_parallel`); every rank returns every sample whole, as the shared forward does
under CP. Sliding windows run as in the group driver. MoE router statistics are each cross
micro-batch's plain micro-batch's, as in the group driver, under context and sequence
parallelism too (where verl's own step differs by counting the rows it pads each sample with
for TP and CP, as in one micro-batch: ``tests/verl_ext/test_cross_moe_sequence_parallel.py``;
equal where no sample is padded). Routing
replay (verl's ``router_replay``): the group was cut on tokens and routes at the split
(:mod:`.cross_groups`), the prefix replays its rows' routes and every micro-batch its tails'
(:func:`replayed_routes`, checked against the micro-batch's own); ``R2``'s recording forward
takes the ordinary split. Under pipeline parallelism, interleaved stages included, the prefix
rides in the group's first and last micro-batch on every stage instead (:mod:`.cross_pipeline`;
one level: a group that would nest takes the ordinary split). Each refusal raises one error
naming the setting.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import PrefixSharingConfig
from .cross_groups import CrossPart
from .cross_state import GroupState, Readout, check_temperature, leaves_of
from .mcore import SharingMetrics, check_text_only, micro_batch_temperature

__all__ = ["cross_forward", "pipelined"]


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
    if part.group.nested:  # chunks and sub-tree blocks (.cross_nested)
        from .cross_nested import close_micro_batch, open_micro_batch

        prefix_kv = open_micro_batch(model, part, sharing.backend, readout, device)
    elif part.first:
        part.group.state = _run_prefix(model, part, sharing, readout, device)
    state = part.group.state
    check_temperature(state, temperature)
    if not part.group.nested:
        state.prefix_kv.mode = "read_last" if part.last else "read"
        prefix_kv = state.prefix_kv
    cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat, device)
    plan, tail_plan = suffix.plan.to(device), suffix.tail_plan.to(device)
    params = PlanPackedSeqParams.from_plan(plan, sharing.backend, cp=cp and cp.attention,
                                           prefix_kv=prefix_kv, routes=routes)
    input_ids, position_ids = model_inputs(plan, cp)  # under CP this rank's rows
    output = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                   packed_seq_params=params)[0]  # [rows, V] logits, or [rows, 1] values
    tails = readout.tails(output, tail_plan, cp)
    if part.group.nested:
        prefix = close_micro_batch(part)
    else:
        prefix = state.prefix_stats(list(suffix.members), part.last)
        if part.last:
            part.group.held_bytes = state.prefix_kv.held_bytes()
            part.group.state = None  # the last micro-batch's graph holds what its backward needs
    if metrics is not None:
        metrics.add_tokens(part.tokens_total, part.tokens_computed)
    return readout.verl_output(prefix, tails, tail_plan)


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


def _run_prefix(model, part: CrossPart, sharing: PrefixSharingConfig, readout: Readout,
                device: torch.device) -> GroupState:
    """The group's prefix forward (recording its K/V) and its prefix-position outputs."""
    from ..megatron_ext.cross_run import PrefixPass, block_store

    schedule = part.group.schedule
    # its block is planned padded as the group's other micro-batches are (microbatch.py)
    prefix_kv = block_store(schedule.blocks[0], device)
    prefix = PrefixPass(schedule, prefix_kv, sharing.backend, readout.temperature, device)
    recorded = readout.block(prefix, prefix.forward(model))
    return GroupState(prefix_kv, recorded, leaves_of(recorded), readout.temperature)
