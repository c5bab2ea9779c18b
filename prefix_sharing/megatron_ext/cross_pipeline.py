"""One group's forward+backward through megatron's own schedule, at any pipeline size.

The group driver (:func:`~.cross_micro_batch.forward_backward_group`) runs a
:class:`~prefix_sharing.group_schedule.GroupSchedule`'s steps as micro-batches of
``get_forward_backward_func()``: no pipelining at PP=1, 1F1B under pipeline parallelism, the
interleaved schedule under virtual stages. Each step is a micro-batch of its own
(:func:`_step_table`): a block's forward, a suffix, a block's backward step after its last
reader. At PP=1 a block's graph is kept from its forward to its backward step (unless
``recompute_prefix``); under PP it is not kept across a stage's micro-batches, so every block
is computed again in its backward step (below).

Megatron's 1F1B schedule runs the micro-batches' forwards and their backwards in micro-batch
order on every stage, a few forwards ahead of the backwards, and moves one ``[s, b, h]``
activation (and its gradient) per micro-batch between stages. A prefix micro-batch before its
readers would be backwarded first, before any reader has accumulated its dK/dV. So its pass
with grad runs after them: for a one-level schedule planned to carry it (the common prefix
``P``, ``Lp`` rows, within half the budget, read by suffix micro-batches ``S_1 .. S_k``) the
prefix rides in the first and the last suffix (``docs/cross-micro-batch.md``, "under
pipeline parallelism"); any other schedule runs its blocks as micro-batches of their own
(below):

- ``S_1`` carries the prefix without grad: its activation is ``cat(prefix rows, own rows)``;
  on every stage the prefix rows run under ``torch.no_grad()`` recording each layer's K/V as
  leaves (:class:`~.prefix_kv.PrefixKV`), then ``S_1``'s rows run with grad reading them;
- ``S_2 .. S_{k-1}`` read the leaves: their backwards accumulate dK/dV into them, stage by
  stage;
- ``S_k`` carries the prefix again, with grad: the prefix rows record once more (the leaves
  and their gradients kept), ``S_k``'s rows read the recorded K/V *through*
  (:func:`~.prefix_kv.read_through`: the leaves' accumulated gradients added on the way back),
  and on the last stage the prefix rows' logits score every member's prefix positions. So
  megatron's own backward of ``S_k`` is the prefix's backward, once, on every stage: after the
  other suffixes' backwards there (1F1B keeps their order), with the gradient of the prefix
  rows' output received from the next stage, its input gradient sent to the previous one.

Each micro-batch that carries the prefix runs the stage twice, prefix rows then own rows: the
received activation is split by rows (``set_input_tensor`` on each part) and the two outputs
are sent on as one. The prefix is computed twice (``S_1`` without grad, ``S_k`` with it;
``k = 1``: once, with grad), reported in ``cross_recomputed_tokens``. Held across the group,
per stage: its layers' K/V leaves and their gradients, no prefix activations.

Under sequence parallelism each rank holds its slice of each part's rows (every part padded to
the tensor-parallel size), so the received activation splits at the prefix's rows over TP.
Under context parallelism each part (the carried prefix, the suffix) is split over the CP ranks
as at PP=1 (:mod:`.cross_context_parallel`: the prefix's K/V recorded gathered), the received
activation and the last stage's logits holding this rank's slice of each; megatron's schedule
scales each micro-batch's loss by the CP size.
MoE router statistics as at PP=1 (the prefix rows route without statistics, each suffix's
statistics read ``cat(prefix logits, own)``), each group's router losses weighted by the whole
step's micro-batch count (:func:`_within_the_step`). Activation recompute as at PP=1: a
prefix layer recomputed in ``S_k`` replays inside its backward, after ``S_k``'s own rows'
(created later, so run first by autograd), and injects the leaves' gradients then
(:class:`~.prefix_kv.PrefixKVPass`). Routing replay as at PP=1: the prefix rows replay their
routes in both carrying micro-batches, each suffix its tails'. Interleaved (virtual) stages:
every model chunk of a rank runs the same weave on its own layers (megatron's interleaved
schedule keeps each chunk's forwards and backwards in micro-batch order).

A prefix over half the budget cannot ride beside the tails (nor a nested schedule's chunks
and sub-tree blocks): such a schedule (:func:`~prefix_sharing.cross_micro_batch.plan_group`'s,
at the whole budget) runs its steps as micro-batches of their own (:func:`_step_table`): a
block's forward without grad, the suffixes reading the leaves, and the block's backward step,
its forward again with grad after its last reader, its own rows reading their recorded K/V
with the readers' gradients injected (``record_last``). 1F1B runs the backwards in
micro-batch order on every stage, so the same rule holds as at PP=1: each block's backward
once, after its last reader's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..cross_micro_batch import GroupSchedule
from .cross_context_parallel import (CrossSlice, context_parallel_size, model_inputs,
                                     slice_micro_batch)
from .cross_run import (Collector, GroupRun, PrefixPass, TokenLoss, block_store, score_suffix,
                        sequence_parallel_size, suffix_routes)
from .packed_seq import PlanPackedSeqParams
from .prefix_kv import PrefixKV, PrefixKVStack

__all__ = ["StageRun", "check_interleaved_count", "forward_backward_pipelined_group",
           "stage_forward"]


@dataclasses.dataclass
class StageRun:
    """This stage's forward of one of a group's micro-batches (:func:`stage_forward`).

    Attributes:
        prefix: the carried prefix's pass (the group's first and last micro-batch), or None.
        prefix_output: its rows' output (hidden states ``[rows, 1, h]``; on the last stage
            logits ``[1, rows, V]``), or None.
        output: the micro-batch's own rows' output, likewise.
        cp: the micro-batch's context-parallel slice (None at CP=1).
    """

    prefix: PrefixPass | None
    prefix_output: torch.Tensor | None
    output: torch.Tensor
    cp: CrossSlice | None

    def sent(self, last_stage: bool) -> torch.Tensor:
        """Both parts' rows as one tensor: what megatron's schedule sends to the next stage
        (hidden states, by rows) or hands the loss function (logits)."""
        if self.prefix_output is None:
            return self.output
        return torch.cat([self.prefix_output, self.output], dim=1 if last_stage else 0)


def stage_forward(model: torch.nn.Module, kv: PrefixKV, schedule: GroupSchedule, index: int, *,
                  routes: torch.Tensor | None, backend: str, temperature: float,
                  device: torch.device) -> StageRun:
    """This stage's forward of the group's suffix micro-batch ``index`` inside megatron's
    schedule (module doc): in the group's first and last micro-batch the prefix rows first,
    recording their K/V in ``kv`` (with grad in the last, when grad is enabled), then the
    micro-batch's own rows reading ``kv`` (through it in the last). On a later stage the
    activation received is split at the prefix's rows (this rank's slice of them). ``routes``:
    the routes the micro-batch's flat rows replay (routing replay), or None."""
    count = len(schedule.suffixes)
    first, last = index == 0, index == count - 1
    received = get_attr_wrapped_model(model, "decoder").input_tensor  # None on the first stage
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    # this rank's rows of each part: its CP slice, and of that its TP slice between the layers
    slices = sequence_parallel_size(model) * context_parallel_size()

    def run(params: PlanPackedSeqParams, cp: CrossSlice | None, rows: slice) -> torch.Tensor:
        if received is not None:  # a later stage: its rows of the activation received
            set_input_tensor(received[rows])
        return _forward(model, params, cp)

    prefix = prefix_output = None
    prefix_rows = 0
    if first or last:
        kv.mode = "record"  # a second record keeps the leaves and their gradients
        prefix = PrefixPass(schedule, kv, backend, temperature, device)
        prefix_rows = prefix.params.plan.input_ids.numel() // slices
        with torch.set_grad_enabled(torch.is_grad_enabled() and last):
            prefix_output = run(prefix.params, prefix.cp, slice(0, prefix_rows))
    kv.mode = "read_last" if last else "read"
    suffix = schedule.suffixes[index]
    cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat, device)
    params = PlanPackedSeqParams.from_plan(suffix.plan.to(device), backend,
                                           cp=cp and cp.attention, prefix_kv=kv, routes=routes)
    return StageRun(prefix, prefix_output, run(params, cp, slice(prefix_rows, None)), cp)


def forward_backward_pipelined_group(
    model: list[torch.nn.Module],
    schedule: GroupSchedule,
    token_loss: TokenLoss,
    *,
    backend: str = "auto",
    temperature: float = 1.0,
    keep_logits: bool = False,
    aux_loss_scale: float = 1.0,
    keep_graph: bool = False,
) -> GroupRun:
    """This stage's part of one group's forward+backward (see the module doc); parameter
    gradients accumulate into ``.grad``. Every stage of the pipeline calls it with the same
    schedule (each plans it from its own data: the planner is deterministic).

    A one-level schedule carries its prefix rows in its first and last suffix micro-batch
    (:func:`stage_forward`); a nested one runs its steps as micro-batches of their own
    (:func:`_step_table`). ``model``: this rank's model chunks, one without interleaved
    stages; under them megatron's interleaved schedule runs every chunk through the same
    micro-batches, each chunk's K/V in stores of its own (its forwards and backwards of the
    group's micro-batches stay in micro-batch order, as under 1F1B).

    The :class:`~.cross_run.GroupRun`'s log-probs, entropy, logits and loss are the
    last stage's (zeros and None elsewhere); ``tokens_computed`` counts every block twice
    (a one-level group's prefix once when it has one suffix micro-batch).

    ``aux_loss_scale``: the gradient weight of each suffix micro-batch's MoE router losses, as
    :func:`~.cross_micro_batch.forward_backward_group` takes it (megatron's schedule would give
    them ``1 / num_microbatches`` of this group's alone). ``keep_graph`` (without pipeline
    parallelism only): every schedule runs its steps, each block's graph kept from its forward
    to its backward step (computed once).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model[0].parameters()).device
    out = Collector(schedule.num_tokens_total, device, keep_logits)

    def scaled(loss: torch.Tensor) -> torch.Tensor:
        # megatron's schedule divides each micro-batch's loss by their count (and multiplies
        # it by the CP size), then scales it by the factor (_within_the_step)
        return loss * len(items) / factor

    weave: Weave = (functools.partial(_step_table, keep_graph=True) if keep_graph
                    else _carried_prefix if schedule.carries_prefix else _step_table)
    items, forward_step, run = weave(schedule, len(model), token_loss, out, scaled, backend,
                                     temperature, device)
    check_interleaved_count(len(items), model)
    # every chunk reads its own iterator (megatron's interleaved schedule runs each chunk's
    # forward of a micro-batch at its own time)
    iterators = [iter([(c, item) for item in items]) for c in range(len(model))]
    with _within_the_step(model[0], len(items) * aux_loss_scale) as factor:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(model) > 1 else iterators[0], model=model,
            num_microbatches=len(items), seq_length=run.seq_length, micro_batch_size=1)
    held = run.held()
    metrics = schedule.metrics(recompute_prefix=run.again > 0)
    metrics["prefix_sharing/cross_held_bytes"] = float(held)
    return out.result(held, schedule.tokens_computed + run.again, metrics)


@dataclasses.dataclass
class _Run:
    """What a weave reports: the most rows one micro-batch of it runs (megatron's
    ``seq_length``), block rows it computes a second time, and (after the run) the most K/V
    leaf bytes it held at once."""

    seq_length: int
    again: int
    held: Callable[[], int]


# A weave: (schedule, model chunks, token loss, collector, loss scaling, backend, temperature,
# device) -> the micro-batches megatron's schedule runs, its forward step, and what it reports.
Weave = Callable[..., tuple[list, Callable, "_Run"]]


def _carried_prefix(schedule: GroupSchedule, chunks: int, token_loss: TokenLoss,
                    out: Collector, scaled: Callable[[torch.Tensor], torch.Tensor],
                    backend: str, temperature: float, device: torch.device):
    """A one-level group's micro-batches: its suffixes, the first and the last carrying the
    prefix rows (:func:`stage_forward`); the prefix computed twice (once with one suffix)."""
    block, count = schedule.blocks[0], len(schedule.suffixes)
    kvs = [block_store(block, device) for _ in range(chunks)]  # one per model chunk
    run = _Run(block.length + max(s.plan.input_ids.numel() for s in schedule.suffixes),
               block.length if count > 1 else 0, lambda: sum(kv.held_bytes() for kv in kvs))

    def forward_step(data_iterator, chunk):
        c, index = next(data_iterator)
        suffix = schedule.suffixes[index]
        stage = stage_forward(chunk, kvs[c], schedule, index,
                              routes=suffix_routes(suffix, device), backend=backend,
                              temperature=temperature, device=device)

        def loss_func(output: torch.Tensor):
            logits = output[0]  # [rows, V] (this CP rank's): the prefix's, then own
            prefix_rows = 0 if stage.prefix is None else stage.prefix_output.size(1)
            loss = score_suffix(logits[prefix_rows:], suffix, token_loss, out, temperature,
                                stage.cp)
            if index == count - 1:  # every member's prefix positions, scored with grad
                loss = loss + stage.prefix.score(logits[:prefix_rows], token_loss, out)
            return scaled(loss), {}

        return stage.sent(get_attr_wrapped_model(chunk, "post_process")), loss_func

    return list(range(count)), forward_step, run


def _step_table(schedule: GroupSchedule, chunks: int, token_loss: TokenLoss, out: Collector,
                scaled: Callable[[torch.Tensor], torch.Tensor], backend: str,
                temperature: float, device: torch.device, *, keep_graph: bool = False):
    """A group's steps, each a micro-batch of its own (module doc): a block's forward
    without grad, recording its K/V leaves; a suffix reading its stack's leaves; the block's
    ``"backward"`` step its forward again with grad (``record_last``: its own rows read their
    recorded K/V with every reader's accumulated gradients injected) and its positions'
    loss. Megatron's schedule runs the backwards in micro-batch order on every stage, and a
    block's backward step comes after its last reader's: so every reader's gradient is in its
    leaves when its backward reads them, and its own backward accumulates into the leaves of
    the blocks it reads, whose backward steps come later.

    ``keep_graph`` (one stage only: nothing is sent between stages): a block's forward runs
    with grad and keeps its graph, its positions scored then; its backward step computes
    nothing, its loss the block's loss plus :meth:`~.prefix_kv.PrefixKV.gradient_term`, so
    megatron's backward of that step is the block's backward, with every reader's dK/dV."""
    stores: list[dict[int, PrefixKV]] = [{} for _ in range(chunks)]  # per chunk: live blocks
    kept: dict[tuple[int, int], torch.Tensor] = {}  # keep_graph: (chunk, block) -> its loss
    peak = [0]
    run = _Run(max(p.input_ids.numel() for p in [*(b.plan for b in schedule.blocks),
                                                   *(s.plan for s in schedule.suffixes)]),
               0 if keep_graph else sum(b.length for b in schedule.blocks), lambda: peak[0])
    cp_size = context_parallel_size()

    def forward_step(data_iterator, chunk):
        c, (kind, i) = next(data_iterator)
        live = stores[c]
        if kind == "suffix":
            suffix = schedule.suffixes[i]
            for r in suffix.reads:
                live[r].mode = "read"
            cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat,
                                   device)
            params = PlanPackedSeqParams.from_plan(
                suffix.plan.to(device), backend, cp=cp and cp.attention,
                prefix_kv=PrefixKVStack([live[r] for r in suffix.reads]),
                routes=suffix_routes(suffix, device))
            return _forward(chunk, params, cp), lambda output: (scaled(score_suffix(
                output[0], suffix, token_loss, out, temperature, cp)), {})
        block = schedule.blocks[i]
        if kind == "forward":
            live[i] = block_store(block, device)
        else:
            peak[0] = max(peak[0], sum(kv.held_bytes() for chunk_stores in stores
                                       for kv in chunk_stores.values()))
        if kind == "backward" and keep_graph:
            # megatron's schedule scales a micro-batch's loss by the CP size; the readers'
            # dK/dV already are
            loss = kept.pop((c, i)) + live.pop(i).gradient_term() / cp_size
            return loss, lambda output: (scaled(output), {})
        for r in block.reads:
            live[r].mode = "read"
        live[i].mode = "record" if kind == "forward" else "record_last"
        prefix = PrefixPass(schedule, PrefixKVStack([live[r] for r in block.reads], live[i]),
                            backend, temperature, device, block=block)
        if kind == "forward":
            with torch.set_grad_enabled(keep_graph):
                output = _forward(chunk, prefix.params, prefix.cp)
            if keep_graph:
                kept[c, i] = prefix.score(output[0], token_loss, out)
            received = get_attr_wrapped_model(chunk, "decoder").input_tensor
            return (_without_gradient(output, received,
                                      get_attr_wrapped_model(chunk, "post_process")),
                    lambda output: (output.sum() * 0, {}))
        output = _forward(chunk, prefix.params, prefix.cp)
        del live[i]  # its pass holds what its backward reads
        return output, lambda output: (scaled(prefix.score(output[0], token_loss, out)), {})

    return list(schedule.steps), forward_step, run


def _forward(chunk: torch.nn.Module, params: PlanPackedSeqParams,
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
def _within_the_step(model: torch.nn.Module, factor: float) -> Iterator[float]:
    """Megatron's schedule set up for one group of a step, while the group runs:

    - it weighs each micro-batch's MoE router losses by ``grad_scale_func(1) /
      num_microbatches`` and scales the last stage's loss by ``grad_scale_func`` before its
      backward: that function is multiplied by ``factor`` (the loss function divides its
      loss by it), so a group's router losses get the weight of the whole step's micro-batch
      count, as the stock step over all of them gives;
    - it would reduce the gradients over data parallelism after the group's last micro-batch
      (``finalize_model_grads_func``, and the bucket reductions outside ``no_sync_func``):
      the whole group runs inside ``no_sync_func`` instead and nothing is finalized, so the
      step's later groups still accumulate; the caller finalizes after its last group, as
      megatron's schedule does after the step's last micro-batch;
    - it sets the MoE router losses' scale by copying into the one megatron holds, which may
      have another shape (``[]`` when the autoscaler's own backward made it): the group sets
      one of its own, and the one held before is held again after it."""
    config = get_attr_wrapped_model(model, "config")
    saved = config.grad_scale_func, config.no_sync_func, config.finalize_model_grads_func
    scale = saved[0]
    # one per model chunk under interleaved stages
    no_sync = saved[1] if isinstance(saved[1], list) else [saved[1]] if saved[1] else []
    config.grad_scale_func = ((lambda t: t * factor) if scale is None
                              else (lambda t: scale(t) * factor))
    config.no_sync_func = config.finalize_model_grads_func = None
    autoscaler = None
    if config.num_moe_experts:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler as autoscaler

        held, autoscaler.main_loss_backward_scale = autoscaler.main_loss_backward_scale, None
    try:
        with contextlib.ExitStack() as within:
            for func in no_sync:
                within.enter_context(func())
            yield factor
    finally:
        config.grad_scale_func, config.no_sync_func, config.finalize_model_grads_func = saved
        if autoscaler is not None:
            autoscaler.main_loss_backward_scale = held


def check_interleaved_count(count: int, model: list[torch.nn.Module]) -> None:
    """Raises ValueError when megatron's interleaved schedule (``model``: more than one chunk)
    does not take ``count`` micro-batches in one call: it runs them in groups of
    ``microbatch_group_size_per_vp_stage``, which must not exceed their count, and a last,
    partial group of fewer than the pipeline size."""
    if len(model) == 1:
        return
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    group = get_attr_wrapped_model(model[0], "config").microbatch_group_size_per_vp_stage or pp
    if group > count or 0 < count % group < pp:
        raise ValueError(
            f"a group run in {count} micro-batch(es) under interleaved pipeline stages: "
            f"megatron's interleaved schedule runs them in groups of {group} (at PP={pp}), at "
            f"least one, and a last partial group of at least {pp}; plan the group with "
            "another token budget")
