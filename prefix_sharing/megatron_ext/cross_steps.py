"""The one executor of a group run across micro-batches in megatron: its shared blocks as
micro-batches of megatron's own schedule.

A :class:`~prefix_sharing.group_schedule.GroupSchedule`'s steps run in order, each a
micro-batch of ``get_forward_backward_func()`` (no pipelining at PP=1, 1F1B under pipeline
parallelism, the interleaved schedule under virtual stages), whoever owns the loop: megatron's
group driver (:func:`~.cross_micro_batch.forward_backward_group`) or verl's engine
(:mod:`prefix_sharing.verl_ext.cross_schedule`), which differ only in what a suffix
micro-batch reads out per token and scores (:class:`GroupSteps` takes a :data:`ReadOut`). What
each step does to the group's blocks, and the one gradient rule, are
:class:`~prefix_sharing.cross_blocks.GroupBlocks`'; here each step is a micro-batch of
megatron's schedule:

- ``("forward", b)``: block ``b``'s forward (on the last stage its members' per-token outputs
  read out), handing the schedule an output whose backward does nothing;
- ``("suffix", j)``: the caller's micro-batch, reading its blocks' K/V leaves in place
  (:meth:`GroupSteps.suffix_forward`, :meth:`~prefix_sharing.cross_blocks.GroupBlocks.heads`);
- ``("backward", b)``: the block's backward, as the step's loss: the kept graph's term at
  PP=1, or the block's forward again with grad (on every stage: nothing is sent between
  stages for a graph kept across micro-batches) and its recomputed outputs' term. The step's
  loss is handed over so that megatron's scaling leaves it as is
  (:meth:`GroupSteps.block_step`: the leaves' gradients were scaled by their readers' steps).

Megatron's schedules run the backwards in micro-batch order on every stage, so a block's
backward step runs after its last reader's. The last step of a group is its root block's
backward, a whole-model backward as any micro-batch's, so megatron's overlapped gradient
reduction in a step's last micro-batch sees every parameter's gradient arrive once (running a
block's backward inside its last reader's instead cost 199.5 vs 163.3 MiB on the ``small``
preset's history workload).

Megatron's activation recompute runs inside a block (a recomputed layer replays its first
run's mode, :class:`~prefix_sharing.prefix_kv.PrefixKVPass`); context parallelism splits every
micro-batch, a block's included, over the CP ranks (:mod:`.cross_context_parallel`: a block's
K/V recorded gathered); MoE router statistics and routing replay as in :mod:`.cross_run`.
Under interleaved stages every model chunk runs the same steps on its own layers, its K/V in
stores of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..cross_blocks import GroupBlocks, Statistics
from ..group_schedule import GroupSchedule
from .cross_context_parallel import (CrossSlice, context_parallel_size, model_inputs,
                                     slice_micro_batch)
from .cross_run import PrefixPass
from .packed_seq import PlanPackedSeqParams

__all__ = ["GroupSteps", "ReadOut", "Statistics", "fit_interleaved", "forward",
           "within_the_step"]

# a block's per-token outputs from its pass and the pass's output rows (the last stage's)
ReadOut = Callable[[PrefixPass, torch.Tensor], Statistics]
# a micro-batch of megatron's schedule: its output and its loss function
Step = tuple[torch.Tensor, Callable]


class GroupSteps(GroupBlocks):
    """One group's shared blocks while megatron's schedule runs its steps (module doc).

    Args:
        schedule: the group.
        chunks: this rank's model chunks (one without interleaved pipeline stages); megatron's
            schedule reads its settings (``grad_scale_func``) from the first one's config.
        read_out: what a block's members read out at its positions, from its pass's output.
        keep_graph: keep each block's graph from its forward step to its backward step
            (one pipeline stage only); else compute it again there.
        training: whether backward steps follow (else the blocks run once, without grad).
        backend, temperature, device: as :class:`~.cross_run.PrefixPass` takes them.
    """

    def __init__(self, schedule: GroupSchedule, chunks: list[torch.nn.Module],
                 read_out: ReadOut, *,
                 keep_graph: bool, training: bool, backend: str, temperature: float,
                 device: torch.device) -> None:
        super().__init__(schedule, keep_graph=keep_graph, training=training, device=device,
                         stages=len(chunks))
        self.read_out = read_out
        self.backend, self.temperature = backend, temperature
        self._config = get_attr_wrapped_model(chunks[0], "config")

    @property
    def seq_length(self) -> int:
        """The most rows one of its micro-batches runs."""
        return max(p.input_ids.numel() for p in [*(b.plan for b in self.schedule.blocks),
                                                 *(s.plan for s in self.schedule.suffixes)])

    def suffix_forward(self, chunk_index: int, chunk: torch.nn.Module, index: int,
                       routes: torch.Tensor | None) -> tuple[torch.Tensor, CrossSlice | None]:
        """Suffix micro-batch ``index``'s model call on ``chunk`` (the ``chunk_index``-th of
        this rank): its rows (under CP this rank's) reading its blocks' K/V leaves in place,
        in row order, replaying ``routes`` (its flat rows', or None); and its CP slice."""
        suffix = self.schedule.suffixes[index]
        stack = self.suffix_stack(chunk_index, index)
        cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat,
                               self.device)
        params = PlanPackedSeqParams.from_plan(
            suffix.plan.to(self.device), self.backend, cp=cp and cp.attention,
            prefix_kv=stack, routes=routes)
        return forward(chunk, params, cp), cp

    def block_step(self, chunk_index: int, chunk: torch.nn.Module, kind: str, b: int,
                   num_microbatches: int) -> Step:
        """Megatron's forward step of block ``b``'s ``"forward"`` or ``"backward"`` step on
        ``chunk`` (the ``chunk_index``-th of this rank), in a call of megatron's schedule over
        ``num_microbatches`` micro-batches."""
        block = self.schedule.blocks[b]
        last_stage = get_attr_wrapped_model(chunk, "post_process")
        as_is = self._as_is(num_microbatches)
        if kind == "backward" and self.keep_graph:  # the kept graph's backward
            return self.kept_term(chunk_index, b), as_is
        prefix = PrefixPass(self.schedule, self.block_stack(chunk_index, b, kind),
                            self.backend, self.temperature, self.device, block=block)
        if kind == "forward":
            with torch.set_grad_enabled(self.keep_graph):
                output = forward(chunk, prefix.params, prefix.cp)
                if last_stage:
                    self.recorded(chunk_index, b, self.read_out(prefix, output[0]))
            received = get_attr_wrapped_model(chunk, "decoder").input_tensor
            return (_without_gradient(output, received, last_stage),
                    lambda output: (output.sum() * 0, {}))
        output = forward(chunk, prefix.params, prefix.cp)
        leaves = self.release(chunk_index, b)  # its pass holds what its backward reads

        def loss_func(output: torch.Tensor):
            return as_is(self.recomputed_term(self.read_out(prefix, output[0]), leaves))

        return output, loss_func

    def _as_is(self, num_microbatches: int) -> Callable:
        """A loss function handing megatron's schedule a term whose backward, after the
        schedule's scaling (``x CP size / num_microbatches`` and ``grad_scale_func``), is the
        term's own: the gradients it carries were scaled by the steps that accumulated them."""
        config = self._config

        def as_is(term: torch.Tensor):
            scale = (config.grad_scale_func(torch.ones((), device=term.device))
                     if config.grad_scale_func is not None else 1.0)
            return term * num_microbatches / (context_parallel_size() * scale), {}

        return as_is


def forward(chunk: torch.nn.Module, params: PlanPackedSeqParams,
            cp: CrossSlice | None) -> torch.Tensor:
    """One model call on this stage (the activation received is the schedule's to set)."""
    input_ids, position_ids = model_inputs(params.plan, cp)
    return chunk(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                 packed_seq_params=params)


def _without_gradient(output: torch.Tensor, received: torch.Tensor | None,
                      last_stage: bool) -> torch.Tensor:
    """A micro-batch whose backward does nothing, as megatron's schedule needs its output: a
    tensor its backward step can run on, handing the previous stage a zero gradient (its
    backward receives one, as for every micro-batch). On the last stage a scalar: the loss
    function reads no logits, so none is backpropagated through."""
    output = (output.new_zeros(()) if last_stage else output).detach()
    if received is None:  # the first stage: nothing to hand back
        return output.requires_grad_()
    return output + received.sum() * 0


@contextlib.contextmanager
def within_the_step(model: torch.nn.Module, factor: float, *,
                    accumulate: bool) -> Iterator[float]:
    """Megatron's schedule set up for a call that runs more micro-batches than the step
    counts (a group's block steps among them), while the call runs:

    - it weighs each micro-batch's MoE router losses by ``grad_scale_func(1) /
      num_microbatches`` and scales the last stage's loss by ``grad_scale_func`` before its
      backward: that function is multiplied by ``factor`` (a loss function divides its
      loss by it), so the router losses get the weight of the step's own micro-batch count;
    - with ``accumulate`` (a group of a step that runs several calls: megatron's group
      driver) it would reduce the gradients over data parallelism after the call's last
      micro-batch (``finalize_model_grads_func``, and the bucket reductions outside
      ``no_sync_func``): the whole call runs inside ``no_sync_func`` instead and nothing is
      finalized, so the step's later groups still accumulate; the caller finalizes after
      its last group, as megatron's schedule does after the step's last micro-batch;
    - it sets the MoE router losses' scale by copying into the one megatron holds, which may
      have another shape (``[]`` when the autoscaler's own backward made it): the call sets
      one of its own, and the one held before is held again after it."""
    config = get_attr_wrapped_model(model, "config")
    saved = config.grad_scale_func, config.no_sync_func, config.finalize_model_grads_func
    scale = saved[0]
    # one per model chunk under interleaved stages
    no_sync = saved[1] if isinstance(saved[1], list) else [saved[1]] if saved[1] else []
    config.grad_scale_func = ((lambda t: t * factor) if scale is None
                              else (lambda t: scale(t) * factor))
    if accumulate:
        config.no_sync_func = config.finalize_model_grads_func = None
    autoscaler = None
    if config.num_moe_experts:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler as autoscaler

        held, autoscaler.main_loss_backward_scale = autoscaler.main_loss_backward_scale, None
    try:
        with contextlib.ExitStack() as within:
            for func in (no_sync if accumulate else []):
                within.enter_context(func())
            yield factor
    finally:
        config.grad_scale_func, config.no_sync_func, config.finalize_model_grads_func = saved
        if autoscaler is not None:
            autoscaler.main_loss_backward_scale = held


def fit_interleaved(items: list, model: list[torch.nn.Module],
                    is_block_forward: Callable[[object], bool]) -> list:
    """``items`` (a call's micro-batches) as megatron's interleaved schedule (``model``: more
    than one chunk) takes them in one call: it runs them in groups of
    ``microbatch_group_size_per_vp_stage``, at least one, and a last partial group of no fewer
    than the pipeline size. A call that does not fit gets its first block's forward step
    repeated right after it (``is_block_forward`` finds it) until it does: the repeat records
    the same K/V and outputs again before any reader (a block's forward step keeps no graph
    under pipeline parallelism), so the result is the same; it costs a block's forward each.
    Without interleaved stages ``items`` as they are."""
    if len(model) == 1:
        return items
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    group = get_attr_wrapped_model(model[0], "config").microbatch_group_size_per_vp_stage or pp
    extra = 0
    while len(items) + extra < group or 0 < (len(items) + extra) % group < pp:
        extra += 1
    if not extra:
        return items
    first = next((j for j, item in enumerate(items) if is_block_forward(item)), None)
    if first is None:
        raise ValueError(f"{len(items)} micro-batch(es) under interleaved pipeline stages: "
                         f"megatron's interleaved schedule runs them in groups of {group} (at "
                         f"PP={pp}), at least one, and a last partial group of at least {pp}")
    return items[:first + 1] + [items[first]] * extra + items[first + 1:]
