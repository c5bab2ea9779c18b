"""A cross group's micro-batches in verl's Megatron engine: its shared blocks' steps among
verl's micro-batches in one call of megatron's schedule, and the forward of each of verl's.

A :class:`~.cross_groups.CrossGroup` is run as consecutive verl micro-batches (its schedule's
suffix micro-batches), each holding the samples whose tails it computes: verl's loss reads
every sample's full row. verl's engine runs a step's micro-batches through megatron's schedule,
which it looks up in its ``transformer_impl`` module (``get_forward_backward_func``) at call
time. While a sharing engine runs a step whose split holds cross groups, that lookup answers
:func:`run_with_blocks`: each group's steps run through the one executor
(:class:`~prefix_sharing.megatron_ext.cross_steps.GroupSteps`), its blocks' forward and
backward steps - a one-level group's common prefix; a nested group's prefix chunks and sub-tree
blocks - as micro-batches of their own around verl's micro-batches, which run verl's own
forward step. At PP=1 a one-level group's blocks keep their graph from their forward step to
their backward step (computed once; its tails were packed under the budget less the prefix); a
nested group's (its prefix too long to keep) and every group's under pipeline parallelism are
computed again in their backward step (``cross_recomputed_tokens``).

What verl sees is its own: its micro-batches' entries of megatron's ``losses_reduced`` (the
block steps' are dropped), its loss scaled by its micro-batch count and the MoE router losses
weighted by it (:func:`~prefix_sharing.megatron_ext.cross_steps.within_the_step`), and
megatron's data-parallel reduction after the call's last micro-batch (a group's last step is
its root block's backward, a whole-model backward as any micro-batch's).

Each of verl's micro-batches (:func:`cross_forward`, its model forward) reads its blocks' K/V
leaves in place and hands verl each sample's outputs as verl expects them: at its blocks'
positions the blocks' per-token outputs (as leaves, so its backward accumulates their
gradients), at its tail's its own (the log-prob at ``t`` scores token ``t + 1``, the last
position 0; the critic's values likewise, :class:`.cross_state.Readout`). So verl's loss runs
unchanged on each micro-batch.

**Settings** (each tested against verl's stock step): activation recompute (full or
selective), tensor parallelism with or without sequence parallelism (each micro-batch's rows,
a block's included, padded to the tensor-parallel size; a block's pad rows are not kept),
context parallelism (each micro-batch split over the CP ranks and padded to their count, a
block's K/V recorded gathered: :mod:`~prefix_sharing.megatron_ext.cross_context_parallel`;
every rank returns every sample whole, as the shared forward does under CP), sliding windows,
pipeline parallelism with interleaved stages, nested groups under each of those, MoE router
statistics (each cross micro-batch's plain micro-batch's, as in the group driver; where verl's
own step differs by counting the rows it pads each sample with for TP and CP:
``tests/verl_ext/test_cross_moe_sequence_parallel.py``) and routing replay (verl's
``router_replay``: the group was cut on tokens and routes at the split, :mod:`.cross_groups`;
a block replays its rows' routes and every micro-batch its tails', :func:`replayed_routes`,
checked against the micro-batch's own; ``R2``'s recording forward takes the ordinary split).
Each refusal raises one error naming the setting.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from ..config import PrefixSharingConfig
from .cross_groups import CrossPart
from .cross_state import Readout, check_temperature
from .mcore import (SharingMetrics, check_text_only, last_chunk_of_rank,
                   micro_batch_temperature)
from .microbatch import active_split

__all__ = ["cross_forward", "cross_schedule", "replayed_routes", "run_with_blocks"]


@contextlib.contextmanager
def cross_schedule(module: ModuleType, value_model: bool) -> Iterator[None]:
    """Within this block, ``module.get_forward_backward_func()`` (verl's engine module) answers
    :func:`run_with_blocks` over megatron's schedule; ``value_model``: the engine is the
    critic's (its blocks read out values)."""
    stock = module.get_forward_backward_func

    @functools.wraps(stock)
    def lookup(*args: Any, **kwargs: Any) -> Callable:
        return functools.partial(run_with_blocks, stock(*args, **kwargs),
                                 value_model=value_model)

    module.get_forward_backward_func = lookup
    try:
        yield
    finally:
        module.get_forward_backward_func = stock


def run_with_blocks(schedule: Callable, *, forward_step_func: Callable, data_iterator: Any,
                    model: Any, num_microbatches: int, value_model: bool = False,
                    forward_only: bool = False, **kwargs: Any) -> list:
    """megatron's ``schedule`` (a ``forward_backward_func``) over verl's micro-batches with
    every cross group's block steps among them (module doc); arguments as megatron's
    schedule takes them, ``value_model`` as :func:`cross_schedule`'s."""
    from megatron.core.utils import get_attr_wrapped_model

    from ..megatron_ext.cross_steps import GroupSteps, fit_interleaved, within_the_step

    chunks = model if isinstance(model, list) else [model]
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    batches = list(iterators[0])  # every chunk's iterator yields the same micro-batches
    record = active_split()
    parts = [None if record is None else record.part(b) for b in batches]
    at = {(id(p.group), p.index): k for k, p in enumerate(parts) if p is not None}
    config = get_attr_wrapped_model(chunks[0], "config")
    pipelined = config.pipeline_model_parallel_size > 1
    device = next(chunks[0].parameters()).device
    items: list[tuple[str, int, Any]] = []  # ("batch", k, None) or (kind, block, its steps)
    for k, part in enumerate(parts):
        if part is None:
            items.append(("batch", k, None))
        elif part.first:
            group = part.group
            first = batches[k]
            # the actor's sampling temperature (the critic's forward takes none)
            temperature = 1.0 if value_model else micro_batch_temperature(first["temperature"])
            readout = Readout(value_model, temperature, _calculate_entropy(first))
            group.state = steps = GroupSteps(
                group.schedule, chunks, readout.block,
                keep_graph=not (group.nested or pipelined), training=not forward_only,
                backend=record.config.backend, temperature=readout.temperature,
                device=device)
            items += [("batch", at[id(group), i], None) if kind == "suffix" else (kind, i, steps)
                      for kind, i in steps.steps]
    items = fit_interleaved(items, chunks, lambda item: item[0] == "forward")

    def forward_step(data_iterator, chunk):
        c, (kind, i, steps) = next(data_iterator)
        if kind == "batch":
            return forward_step_func(iter([batches[i]]), chunk)
        return steps.block_step(c, chunk, kind, i, len(items))

    # megatron divides each loss by the call's micro-batch count, verl's by its own
    factor = 1.0 if config.calculate_per_token_loss else len(items) / num_microbatches
    runs = [iter([(c, item) for item in items]) for c in range(len(chunks))]
    with within_the_step(chunks[0], factor, accumulate=False):
        losses = schedule(forward_step_func=forward_step,
                          data_iterator=runs if isinstance(data_iterator, list) else runs[0],
                          model=model, num_microbatches=len(items), forward_only=forward_only,
                          **kwargs)
    for part in parts:
        if part is not None and part.last:
            group = part.group
            group.held_bytes = group.state.held_bytes
            group.recomputed_tokens = group.state.recomputed_tokens
            group.state = None
    if not losses:  # an inner pipeline stage
        return losses
    return [loss for loss, item in zip(losses, items, strict=True) if item[0] == "batch"]


def _calculate_entropy(batch: Any) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(batch, key="calculate_entropy", default=False))


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
    from megatron.core.utils import get_attr_wrapped_model, unwrap_model

    from ..megatron_ext import check_sharing_model

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
    steps = part.group.state  # the group's GroupSteps (.cross_schedule)
    check_temperature(steps, temperature)
    chunk = getattr(unwrap_model(model), "vp_stage", None) or 0
    output, cp = steps.suffix_forward(chunk, model, part.index, routes)
    tail_plan = suffix.tail_plan.to(device)
    if metrics is not None and last_chunk_of_rank(unwrap_model(model)):
        # the blocks computed again in their backward steps, with the group's last
        metrics.add_tokens(part.tokens_total, part.tokens_computed + (
            steps.recomputed_tokens if part.last else 0))
    if not get_attr_wrapped_model(model, "post_process"):  # hidden states for the next stage
        return output
    tails = readout.tails(output[0], tail_plan, cp)  # [rows, V] logits, or [rows, 1] values
    heads = steps.heads(chunk, part.index, list(suffix.members))
    return readout.verl_output(heads, tails, tail_plan)


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
