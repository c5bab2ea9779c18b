"""verl's micro-batches and its cross groups' shared blocks in one call of megatron's schedule.

verl's Megatron engine runs a step's micro-batches through megatron's schedule, which it looks
up in its ``transformer_impl`` module (``get_forward_backward_func``) at call time. While a
sharing engine runs a step whose split holds groups across micro-batches
(:mod:`.cross_groups`), that lookup answers :func:`run_with_blocks`: each group's steps run
through the one executor (:class:`~prefix_sharing.megatron_ext.cross_steps.GroupSteps`), its
blocks' forward and backward steps as micro-batches of their own around verl's micro-batches,
which are the group's suffixes and run verl's own forward step (their model forward:
:mod:`.cross_forward`). At PP=1 a one-level group's blocks keep their graph from their forward
step to their backward step (computed once; its tails were packed under the budget less the
prefix); a nested group's (its prefix too long to keep) and every group's under pipeline
parallelism are computed again in their backward step (``cross_recomputed_tokens``).

What verl sees is its own: its micro-batches' entries of megatron's ``losses_reduced`` (the
block steps' are dropped), its loss scaled by its micro-batch count and the MoE router losses
weighted by it (:func:`~prefix_sharing.megatron_ext.cross_steps.within_the_step`), and
megatron's data-parallel reduction after the call's last micro-batch (a group's last step is
its root block's backward, a whole-model backward as any micro-batch's).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from .cross_state import Readout
from .mcore import micro_batch_temperature
from .microbatch import active_split

__all__ = ["cross_schedule", "run_with_blocks"]


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

    from ..megatron_ext.cross_steps import GroupSteps, check_interleaved_count, within_the_step

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
    check_interleaved_count(len(items), chunks)

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
