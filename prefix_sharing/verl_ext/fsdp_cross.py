"""Cross groups in verl's FSDP engine: a group's shared blocks run around its micro-batches in
verl's own loop.

verl's FSDP engine runs a step's micro-batches as a plain loop (``forward_step``, then
``loss.backward()``, per micro-batch). A :class:`~.cross_groups.CrossGroup` is consecutive
micro-batches of that loop (its schedule's suffix micro-batches), each holding the samples whose
tails it computes; its block steps run through
:class:`~prefix_sharing.fsdp_compat.cross_steps.HFGroupSteps`:

- before a cross micro-batch's model call (``prepare_model_inputs``), the steps before it
  (its blocks' forwards; the backwards of blocks whose last reader was the micro-batch before,
  whose backward verl has run by then); its model keywords read its blocks' K/V in place;
- under Ulysses every model call runs this rank's rows of its plan (padded to the group's
  size), the attention the whole rows of this rank's heads, where the blocks' K/V are recorded
  and read; a block's and a micro-batch's tails' log-probs are scored by the rank holding
  their rows and gathered (:mod:`prefix_sharing.fsdp_compat.ulysses`);
- its outputs (``prepare_model_outputs``) are verl's per sample: at its blocks' positions the
  blocks' per-token outputs, as leaves, so verl's backward of its loss accumulates their
  gradients; at its tails' its own (:class:`.cross_state.Readout`);
- the group's remaining steps (its blocks' backwards) run when the next micro-batch starts,
  or after verl's loop (:meth:`CrossLoop.forward_backward_batch`).

Every block is computed again in its backward step (``cross_recomputed_tokens``): FSDP frees a
module's gathered parameters after its forward and gathers them again when the backward reaches
the module's output, and a kept block graph's backward enters at its recorded K/V, inside the
layers, where no such hook runs (checked: the kept graph's backward meets the freed
parameters). So nothing is gained by keeping a group's prefix beside its tails: every group
nests, its tails packed under the whole budget (the engine's ``keeps_cross_prefix``,
:func:`.cross_groups.plan_cross_groups`). Each block step is a model call of its own
under verl's autocast, and each backward step an ``autograd.backward`` of its own; FSDP
reduces its gradients as a micro-batch's (after verl's loop, with gradient synchronisation on:
the last group's closing steps reduce once more each, which changes no sum).
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import Any

import torch

from ..fsdp_compat.cross_steps import HFGroupSteps, block_log_probs, block_values
from ..fsdp_compat.ulysses import ulysses_split
from .cross_groups import CrossGroup, CrossPart
from .cross_state import Readout, check_temperature
from .mcore import micro_batch_temperature
from .microbatch import active_split
from .ulysses import sequence_parallel_group

__all__ = ["CrossLoop"]


@dataclasses.dataclass
class _Open:
    """The group whose steps are running, and its micro-batches' sampling temperature."""

    group: CrossGroup
    temperature: float


class CrossLoop:
    """Mixed into verl's FSDP engine under the sharing mixin (module doc): its
    ``prepare_model_inputs`` / ``prepare_model_outputs`` hand a cross micro-batch to
    :meth:`cross_inputs` / :meth:`cross_outputs`."""

    value_head = False
    _open: _Open | None = None

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False):
        """verl's step, then the last cross group's closing steps."""
        self._open = None
        output = super().forward_backward_batch(data, loss_function, forward_only)
        self._close()
        return output

    def cross_part(self, micro_batch: Any) -> CrossPart | None:
        """The cross-group micro-batch ``micro_batch`` is, or None; an open group whose
        micro-batches are over runs its remaining steps first."""
        record = active_split()
        part = None if record is None else record.part(micro_batch)
        if self._open is not None and (part is None or part.group is not self._open.group):
            self._close()
        return part

    def cross_inputs(self, micro_batch: Any, part: CrossPart,
                     device: torch.device) -> tuple[dict, dict]:
        """The model keywords and output arguments of cross micro-batch ``part`` (its blocks'
        steps before it run first)."""
        from verl.utils import tensordict_utils as tu

        suffix = part.group.schedule.suffixes[part.index]
        samples = micro_batch["input_ids"].size(0)
        if samples != len(suffix.members):
            raise ValueError(f"micro-batch {part.index} of a cross-micro-batch group holds "
                             f"{samples} samples; its plan has {len(suffix.members)}")
        temperature = 1.0 if self.value_head else micro_batch_temperature(
            micro_batch["temperature"])
        readout = Readout(self.value_head, temperature, bool(tu.get_non_tensor_data(
            micro_batch, key="calculate_entropy", default=False)))
        ulysses = sequence_parallel_group(self)
        if part.first:
            block = (block_values if self.value_head else
                     partial(block_log_probs, temperature=temperature,
                             with_entropy=readout.with_entropy, ulysses=ulysses))
            part.group.state = HFGroupSteps(
                part.group.schedule, lambda inputs: self.model_rows(self.model_call(inputs)), block,
                keep_graph=False, training=torch.is_grad_enabled(),  # (module doc)
                backend=self.prefix_sharing.backend, device=device, ulysses=ulysses)
            self._open = _Open(part.group, temperature)
        check_temperature(self._open, temperature)
        steps = part.group.state
        model_inputs = steps.suffix_kwargs(part.index)
        del model_inputs["use_cache"]  # verl's forward_step passes use_cache=False itself
        self._sharing_metrics.add_tokens(part.tokens_total, part.tokens_computed + (
            steps.recomputed_tokens if part.last else 0))
        # its tails' plan on the device: what its outputs are scored and laid out by
        output_args = {"cross": part, "readout": readout, "tail_plan": suffix.tail_plan.to(device)}
        if ulysses is not None:  # the tails' positions this rank's rows score
            output_args["ulysses"] = ulysses_split(output_args["tail_plan"], ulysses)
        return model_inputs, output_args

    def cross_outputs(self, output: Any, output_args: dict, tails: tuple) -> Any:
        """verl's outputs of a cross micro-batch: its blocks' per-token outputs (leaves) then
        its tails' (``tails``: in its tail plan's packed order; the critic's from ``output``)."""
        part, readout, tail_plan = (output_args[k] for k in ("cross", "readout", "tail_plan"))
        if self.value_head:
            tails = tail_plan.restore(self.model_rows(output)), None
        members = list(part.group.schedule.suffixes[part.index].members)
        result = readout.verl_output(part.group.state.heads(0, part.index, members), tails,
                                     tail_plan)
        return {"values": result} if self.value_head else result

    def model_call(self, inputs: dict) -> Any:
        """The model on a block's keywords, under the autocast verl's ``forward_step`` runs
        its model call in."""
        from verl.utils.device import get_device_name

        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast = (contextlib.nullcontext() if dtype == torch.float32
                    else torch.autocast(device_type=get_device_name(), dtype=dtype))
        with autocast:
            return self.module(**inputs)  # (model_kwargs: use_cache=False)

    def model_rows(self, output: Any) -> torch.Tensor:
        """The model's output rows, ``[rows, ...]``: logits, or the critic's values (trl's
        value head, or a ``num_labels=1`` token classifier, as verl reads them)."""
        if not self.value_head:
            return output.logits[0]
        return output[2][0] if hasattr(self.module, "v_head") else output.logits[0, :, 0]

    def _close(self) -> None:
        """The open group's remaining steps (its blocks' backwards), and its figures."""
        if self._open is None:
            return
        group, self._open = self._open.group, None
        steps = group.state
        steps.finish()
        group.held_bytes = steps.held_bytes
        group.recomputed_tokens = steps.recomputed_tokens
        group.state = None
