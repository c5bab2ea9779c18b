"""verl's Megatron forward for a micro-batch of a cross group under pipeline parallelism.

verl runs its micro-batches through megatron's own 1F1B schedule: on every stage the forwards
and the backwards go in micro-batch order, a stage's forwards a few ahead of its backwards. A
prefix forward of its own in the group's first micro-batch (as :mod:`.cross_forward` runs it at
PP=1) would be backwarded there, before any reader has accumulated its dK/dV. So the group is
woven as the group driver weaves it (:mod:`prefix_sharing.megatron_ext.cross_pipeline`): the
prefix rows ride in the first and the last micro-batch of the group, on every stage.

- the **first** micro-batch carries the prefix without grad: each stage runs the prefix rows
  under ``torch.no_grad()`` recording each layer's K/V as leaves
  (:class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKV`), then its own rows with grad
  reading them; the last stage turns the prefix rows' logits into every sample's prefix-position
  statistics, kept as leaves too (:class:`.cross_state.GroupState`);
- the **middle** micro-batches read the leaves (K/V, and on the last stage the statistics of
  their samples' prefix positions): their backwards accumulate the prefix's gradients there,
  stage by stage;
- the **last** micro-batch carries the prefix again, with grad: the prefix rows record once
  more (the leaves and their gradients kept), its own rows read the recorded K/V *through*
  (``read_last``), and on the last stage its samples read the recorded statistics through.
  So megatron's backward of that micro-batch is the prefix's backward, once, on every stage,
  after every other reader's (1F1B keeps their order), with the gradient of the prefix rows'
  output received from the next stage and its input gradient sent to the previous one.

A carrying micro-batch runs the stage twice, prefix rows then own rows: the activation
received from the previous stage is split at the prefix's rows (``set_input_tensor`` on each
part), and an inner stage sends both outputs on as one tensor (megatron's
``variable_seq_lengths`` carries its shape). The prefix is computed twice
(``cross_recomputed_tokens``); held across the group, per stage, its layers' K/V leaves and
their gradients, and no prefix activations. Under sequence parallelism each rank holds its
slice of each part's rows (every part padded to the tensor-parallel size), so the received
activation splits at the prefix's rows over TP. Under context parallelism each part is split
over the CP ranks as at PP=1 (:mod:`~prefix_sharing.megatron_ext.cross_context_parallel`), the
received activation and the last stage's logits holding this rank's slice of each, and every
rank returns every sample whole. Built and tested for one-level groups on dense models, at
TP=1, at TP=2 with sequence parallelism and at CP=2, with activation recompute and sliding
windows (:func:`.cross_forward.check_cross_model`).
"""

from __future__ import annotations

import torch

from ..config import PrefixSharingConfig
from .cross_state import GroupState, check_temperature, prefix_statistics, verl_output
from .cross_groups import CrossPart
from .mcore import SharingMetrics

__all__ = ["pipelined_cross_forward"]


def pipelined_cross_forward(model, part: CrossPart, sharing: PrefixSharingConfig,
                            temperature: float, calculate_entropy: bool,
                            metrics: SharingMetrics | None,
                            device: torch.device) -> dict[str, torch.Tensor] | torch.Tensor:
    """This stage's forward of the micro-batch ``part`` (see the module doc): verl's output on
    the last stage, the activation for the next stage before it."""
    from megatron.core.utils import get_attr_wrapped_model

    from ..megatron_ext.cross_context_parallel import (context_parallel_size,
                                                       micro_batch_stats, model_inputs,
                                                       slice_micro_batch)
    from ..megatron_ext.cross_run import PrefixPass, sequence_parallel_size
    from ..megatron_ext.packed_seq import PlanPackedSeqParams
    from ..megatron_ext.prefix_kv import PrefixKV

    group, schedule = part.group, part.group.schedule
    if part.first:
        group.state = GroupState(PrefixKV(rows=schedule.prefix_len), None, None, (None, None),
                                 temperature)
    state = group.state
    check_temperature(state, temperature)
    last_stage = get_attr_wrapped_model(model, "post_process")
    received = get_attr_wrapped_model(model, "decoder").input_tensor  # None on the first stage
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    # this rank's rows of each part: its CP slice, and of that its TP slice between the layers
    slices = sequence_parallel_size(model) * context_parallel_size()

    def run(params: PlanPackedSeqParams, cp, rows: slice) -> torch.Tensor:
        if received is not None:  # a later stage: its rows of the activation received
            set_input_tensor(received[rows])
        input_ids, position_ids = model_inputs(params.plan, cp)
        return model(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                     packed_seq_params=params)

    outputs, prefix_rows = [], 0
    if part.first or part.last:
        state.prefix_kv.mode = "record"  # a second record keeps the leaves and their gradients
        prefix = PrefixPass(schedule, state.prefix_kv, sharing.backend, temperature, device)
        prefix_rows = prefix.params.plan.input_ids.numel() // slices
        training = torch.is_grad_enabled()
        with torch.set_grad_enabled(training and part.last):
            outputs.append(run(prefix.params, prefix.cp, slice(0, prefix_rows)))
            if last_stage:
                recorded = prefix_statistics(prefix, outputs[-1][0], calculate_entropy)
                state.log_probs, state.entropy = recorded
        if last_stage and part.first:
            state.leaves = tuple(None if t is None else t.detach().requires_grad_(training)
                                 for t in recorded)
    state.prefix_kv.mode = "read_last" if part.last else "read"
    suffix = schedule.suffixes[part.index]
    cp = slice_micro_batch(suffix.plan, suffix.tail_plan, suffix.plan.num_tokens_flat, device)
    plan, tail_plan = suffix.plan.to(device), suffix.tail_plan.to(device)
    params = PlanPackedSeqParams.from_plan(plan, sharing.backend, cp=cp and cp.attention,
                                           prefix_kv=state.prefix_kv)
    outputs.append(run(params, cp, slice(prefix_rows, None)))
    if metrics is not None:  # the last micro-batch computes the prefix again
        metrics.add_tokens(part.tokens_total, part.tokens_computed + (
            schedule.prefix_len if part.last and not part.first else 0))
    if part.last:
        group.held_bytes = state.prefix_kv.held_bytes()
        group.recomputed_tokens = 0 if part.first else schedule.prefix_len
        group.state = None  # the last micro-batch's graph holds what its backward needs
    if not last_stage:  # hidden states [rows, 1, h]: both parts, for the next stage
        return torch.cat(outputs, dim=0)
    stats = micro_batch_stats(outputs[-1][0], tail_plan, cp, temperature=temperature,
                              with_entropy=calculate_entropy)
    prefix_stats = state.prefix_stats(list(suffix.members), part.last)
    return verl_output(prefix_stats, stats, tail_plan, calculate_entropy)
