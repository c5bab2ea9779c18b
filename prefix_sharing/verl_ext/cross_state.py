"""What the micro-batches of one cross group read out per token for verl (:class:`Readout`: the
actor's log-probs and entropy, or the critic's values): at a block's positions, kept with the
block as leaves (:class:`~prefix_sharing.cross_blocks.GroupBlocks`), and at its own tails. The
Megatron engine reads both from megatron's output rows (:mod:`.cross_schedule`); the FSDP
engine reads its blocks' through :mod:`prefix_sharing.fsdp_compat.cross_steps` and hands verl
the same :meth:`Readout.verl_output` (:mod:`.fsdp_cross`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..cross_blocks import Statistics
from ..refusals import refuse
from .mcore import PrefixSharingSetupError

__all__ = ["Readout", "check_temperature"]


def check_temperature(state: Any, temperature: float) -> None:
    """A group's micro-batches must share one sampling temperature (its prefix rows serve them
    all); ``state``: the group's, one level or nested, with the temperature of its first."""
    if temperature != state.temperature:
        raise refuse("verl.temperatures", f"a cross-micro-batch group with temperatures "
                     f"{state.temperature} and {temperature}", error=PrefixSharingSetupError)


@dataclasses.dataclass(frozen=True)
class Readout:
    """What a cross micro-batch hands verl per token, read from the last stage's output rows
    (``[rows, V]`` logits, or the critic's ``[rows, 1]`` values): the actor's log-probs (and
    entropy, with ``with_entropy``) at ``temperature``, or with ``value_model`` the critic's
    values. A value at position ``t`` is the output of the row that computed token ``t``, the
    same for every sample holding it; a log-prob at ``t`` scores token ``t + 1``, so a block's
    last position is each sample's own (its pass's stats plan)."""

    value_model: bool
    temperature: float
    with_entropy: bool

    def block(self, prefix: Any, output: torch.Tensor) -> Statistics:
        """``(members, length)`` outputs of a block's members at its positions, from its pass's
        (:class:`~prefix_sharing.megatron_ext.cross_run.PrefixPass`) ``output``."""
        shape = (prefix.num_sequences, prefix.prefix_len)
        if self.value_model:
            return output[: prefix.prefix_len, 0].expand(shape), None
        log_probs, entropy, _ = prefix.stats_of(output, self.with_entropy)
        return log_probs.view(shape), None if entropy is None else entropy.view(shape)

    def tails(self, output: torch.Tensor, tail_plan: Any, cp: Any) -> Statistics:
        """The outputs at every position of ``tail_plan`` (packed), from the micro-batch's own
        rows' ``output`` (under context parallelism this rank's: ``cp``)."""
        if self.value_model:
            return tail_plan.restore(output[:, 0]), None
        from ..megatron_ext.cross_context_parallel import micro_batch_stats

        stats = micro_batch_stats(output, tail_plan, cp, temperature=self.temperature,
                                  with_entropy=self.with_entropy)
        return stats.log_probs, stats.entropy

    def verl_output(self, heads: Statistics, tails: Statistics,
                    tail_plan: Any) -> dict[str, torch.Tensor] | torch.Tensor:
        """verl's output of a cross micro-batch: each sample's outputs at its blocks' positions
        (``heads``: ``(samples, depth)`` each) then at its tail's (``tails`` over
        ``tail_plan``), as jagged nested tensors: the critic's values, or the actor's dict."""
        def per_sample(head: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
            return torch.nested.as_nested_tensor(
                [torch.cat([h, t]) for h, t in zip(head, tail_plan.split(own))],
                layout=torch.jagged)

        if self.value_model:
            return per_sample(heads[0], tails[0])
        result = {"log_probs": per_sample(heads[0], tails[0])}
        if self.with_entropy:
            result["entropy"] = per_sample(heads[1], tails[1])
        return result
