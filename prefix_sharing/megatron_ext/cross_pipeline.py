"""One group's forward+backward under pipeline parallelism, through megatron's own 1F1B.

Megatron's 1F1B schedule (``get_forward_backward_func()``) runs the micro-batches' forwards
and their backwards in micro-batch order on every stage, a few forwards ahead of the backwards,
and moves one ``[s, b, h]`` activation (and its gradient) per micro-batch between stages. A
separate prefix micro-batch would be backwarded first, before any reader has accumulated its
dK/dV; so for a one-level :class:`~prefix_sharing.group_schedule.GroupSchedule` (the common
prefix ``P``, ``Lp`` rows, read by suffix micro-batches ``S_1 .. S_k``) the prefix rides in the
first and the last suffix instead (``docs/cross-micro-batch.md``, "under pipeline
parallelism"):

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
step's micro-batch count (:func:`_router_loss_weight`). Activation recompute as at PP=1: a
prefix layer recomputed in ``S_k`` replays inside its backward, after ``S_k``'s own rows'
(created later, so run first by autograd), and injects the leaves' gradients then
(:class:`~.prefix_kv.PrefixKVPass`). Routing replay as at PP=1: the prefix rows replay their
routes in both carrying micro-batches, each suffix its tails'. Interleaved (virtual) stages:
every model chunk of a rank runs the same weave on its own layers (megatron's interleaved
schedule keeps each chunk's forwards and backwards in micro-batch order). Built for one-level
schedules (:func:`check_pipelined_group`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..cross_micro_batch import GroupSchedule
from ..refusals import refuse
from .checks import UnsupportedSetupError
from .cross_context_parallel import (CrossSlice, context_parallel_size, model_inputs,
                                     slice_micro_batch)
from .cross_run import (Collector, GroupRun, PrefixPass, TokenLoss, block_store, score_suffix,
                        sequence_parallel_size, suffix_routes)
from .packed_seq import PlanPackedSeqParams
from .prefix_kv import PrefixKV

__all__ = ["StageRun", "check_pipelined_group", "forward_backward_pipelined_group",
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
        input_ids, position_ids = model_inputs(params.plan, cp)
        return model(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                     packed_seq_params=params)

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
) -> GroupRun:
    """This stage's part of one group's forward+backward (see the module doc); parameter
    gradients accumulate into ``.grad``. Every stage of the pipeline calls it with the same
    schedule (each plans it from its own data: the planner is deterministic).

    ``model``: this rank's model chunks, one without interleaved stages; under them megatron's
    interleaved schedule runs every chunk through the same weave, each carrying the prefix
    rows of its own layers and recording their K/V in a store of its own (its forwards and
    backwards of the group's micro-batches stay in micro-batch order, as under 1F1B).

    The :class:`~.cross_run.GroupRun`'s log-probs, entropy, logits and loss are the
    last stage's (zeros and None elsewhere); ``tokens_computed`` counts the prefix twice
    (once when the group has one suffix micro-batch).

    ``aux_loss_scale``: the gradient weight of each suffix micro-batch's MoE router losses, as
    :func:`~.cross_micro_batch.forward_backward_group` takes it (megatron's schedule would give
    them ``1 / num_microbatches`` of this group's alone).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_pipelined_group(schedule, model)
    device = next(model[0].parameters()).device
    block = schedule.blocks[0]
    kvs = [block_store(block, device) for _ in model]  # one per model chunk
    count = len(schedule.suffixes)
    out = Collector(schedule.num_tokens_total, device, keep_logits)

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
            # megatron's schedule divides each micro-batch's loss by their count (and
            # multiplies it by the CP size), then scales it by the factor
            # (_router_loss_weight)
            return loss * count / factor, {}

        return stage.sent(get_attr_wrapped_model(chunk, "post_process")), loss_func

    # every chunk reads its own iterator (megatron's interleaved schedule runs each chunk's
    # forward of a micro-batch at its own time)
    iterators = [iter([(c, j) for j in range(count)]) for c in range(len(model))]
    with _router_loss_weight(model[0], count * aux_loss_scale) as factor:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(model) > 1 else iterators[0], model=model,
            num_microbatches=count, seq_length=block.length + max(
                s.plan.input_ids.numel() for s in schedule.suffixes),
            micro_batch_size=1,
        )
    held = sum(kv.held_bytes() for kv in kvs)
    again = block.length if count > 1 else 0
    metrics = schedule.metrics(recompute_prefix=count > 1)
    metrics["prefix_sharing/cross_held_bytes"] = float(held)
    return out.result(held, schedule.tokens_computed + again, metrics)


@contextlib.contextmanager
def _router_loss_weight(model: torch.nn.Module, factor: float) -> Iterator[float]:
    """Megatron's schedule weighs each micro-batch's MoE router losses by ``grad_scale_func(1)
    / num_microbatches`` and scales the last stage's loss by ``grad_scale_func`` before its
    backward: while the group runs, that function is multiplied by ``factor`` (the loss
    function divides its loss by it), so a group's router losses get the weight of the whole
    step's micro-batch count, as the stock step over all of them gives."""
    config = get_attr_wrapped_model(model, "config")
    scale = config.grad_scale_func
    config.grad_scale_func = ((lambda t: t * factor) if scale is None
                              else (lambda t: scale(t) * factor))
    try:
        yield factor
    finally:
        config.grad_scale_func = scale


def check_pipelined_group(schedule: GroupSchedule, model: list[torch.nn.Module]) -> None:
    """Raises for a schedule the pipelined run does not build on ``model`` (this rank's
    chunks): a nested one (:class:`UnsupportedSetupError`), or under interleaved stages one
    whose suffix count megatron's interleaved schedule does not take in one call (ValueError:
    it runs the micro-batches in groups of ``microbatch_group_size_per_vp_stage``, which must
    not exceed their count, and a last, partial group of fewer than the pipeline size)."""
    if not schedule.one_level:
        raise refuse("megatron.cross_micro_batch.pipeline_nested",
                     f"a schedule of {len(schedule.blocks)} shared blocks",
                     error=UnsupportedSetupError)
    if len(model) == 1:
        return
    from megatron.core import parallel_state

    pp, count = parallel_state.get_pipeline_model_parallel_world_size(), len(schedule.suffixes)
    group = get_attr_wrapped_model(model[0], "config").microbatch_group_size_per_vp_stage or pp
    if group > count or 0 < count % group < pp:
        raise ValueError(
            f"a group of {count} suffix micro-batches under interleaved pipeline stages: "
            f"megatron's interleaved schedule runs them in groups of {group} (at PP={pp}), "
            f"at least one, and a last partial group of at least {pp}; plan the group with "
            "another token budget")
