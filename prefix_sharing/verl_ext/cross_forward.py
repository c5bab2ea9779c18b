"""verl's Megatron forward for one micro-batch of a group that runs across micro-batches.

A :class:`~.cross_groups.CrossGroup` is run as consecutive verl micro-batches (its schedule's
suffix micro-batches), each holding the samples whose tails it computes: verl's loss reads
every sample's full row. verl's loop (megatron's ``forward_backward_no_pipelining``) runs each
micro-batch's forward then its backward, in turn, so the schedule's shared blocks - a
one-level group's common prefix; a nested group's prefix chunks and sub-tree blocks - are
woven into them as megatron's group driver weaves them at PP=1
(:class:`~prefix_sharing.megatron_ext.cross_weave.BlockWeave`): each block's forward at the
start of the first micro-batch after it, its backward inside its last reader's, which reads
its K/V and its members' outputs at its positions through; every earlier reader reads them as
leaves. A one-level group keeps its prefix's graph (computed once; its tails were packed under
the budget less the prefix). A nested group's prefix is too long for that (over half the
budget: agent histories longer than ``max_token_len_per_gpu`` included), or its branches do
not fit beside their shared part: its blocks are checkpointed and recomputed by their last
reader's backward (``prefix_sharing/cross_recomputed_tokens``), so no micro-batch holds more
live activation rows than the budget and its tails are packed under the whole budget.

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
own); ``R2``'s recording forward takes the ordinary split. Nested groups run with TP, CP,
windows and MoE router statistics as one-level ones do, but not under megatron's activation
recompute (:func:`nested_problem`; there the engine plans such a group as before, with a
warning and the ``cross_groups_unnested`` metric): megatron's recompute inside a block that is
itself recomputed in its last reader's backward gave gradients 0.7-0.9 off (the embedding's)
when tried. Under pipeline parallelism, interleaved
stages included, a one-level prefix rides in the group's first and last micro-batch on every
stage instead (:mod:`.cross_pipeline`; a group that would nest takes the ordinary split).
Each refusal raises one error naming the setting.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import PrefixSharingConfig
from .cross_groups import CrossPart
from .cross_state import Readout, check_temperature
from .mcore import SharingMetrics, check_text_only, micro_batch_temperature

__all__ = ["cross_forward", "nested_problem", "pipelined"]


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
    from ..megatron_ext.cross_weave import BlockWeave
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
    group = part.group
    if part.first:
        group.state = BlockWeave(group.schedule, readout.block, checkpointed=group.nested,
                                 backend=sharing.backend, temperature=temperature, device=device)
    weave: BlockWeave = group.state
    check_temperature(weave, temperature)
    prefix_kv = weave.open(model, part.index)
    cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat, device)
    plan, tail_plan = suffix.plan.to(device), suffix.tail_plan.to(device)
    params = PlanPackedSeqParams.from_plan(plan, sharing.backend, cp=cp and cp.attention,
                                           prefix_kv=prefix_kv, routes=routes)
    input_ids, position_ids = model_inputs(plan, cp)  # under CP this rank's rows
    output = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                   packed_seq_params=params)[0]  # [rows, V] logits, or [rows, 1] values
    tails = readout.tails(output, tail_plan, cp)
    heads = weave.heads(part.index, list(suffix.members))
    weave.done(part.index)
    group.held_bytes, group.recomputed_tokens = weave.held_bytes, weave.recomputed_tokens
    if part.last:  # its graph holds what its backward needs
        group.state = None
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
    start = suffix.plan.external_rows  # where its tails start: after the blocks it reads
    if replay_routes is None or tails is None or not all(
            torch.equal(r[start:].cpu(), t) for r, t in zip(replay_routes, tails, strict=True)):
        raise ValueError(f"micro-batch {part.index} of a cross-micro-batch group replays routes "
                         "other than those its group was planned with")
    check_padded_statistics(unwrap_model(model))
    return suffix_routes(suffix, device)


def nested_problem(tf_config: Any) -> str | None:
    """Why groups may not nest on a model with this megatron ``TransformerConfig``, or ``None``
    when they may: at PP=1 without activation recompute (the settings the tests compare with
    verl's stock step: TP with sequence parallelism, CP, sliding windows and MoE router
    statistics included; under pipeline parallelism a group runs one level,
    :mod:`.cross_pipeline`)."""
    untested = [f"{name}={value}" for name, value, plain in (
        ("recompute_granularity", getattr(tf_config, "recompute_granularity", None), None),
        ("pipeline_model_parallel_size",
         getattr(tf_config, "pipeline_model_parallel_size", 1) or 1, 1),
    ) if value != plain]
    if not untested:
        return None
    return ("nested schedules run at PP=1 without activation recompute; this model has "
            + ", ".join(untested))
