"""The Megatron engine's cross-micro-batch run: one group over micro-batches of a token budget.

The same loss as :func:`~.megatron.forward_backward` gives the group as one micro-batch
(:func:`~prefix_sharing.equivalence.pg_loss` with the seeded advantages of micro-batch 0),
written as its per-token terms so that each micro-batch scores its own tokens, so the result
compares with :func:`~.megatron.compare` against any one-micro-batch run of the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config import PrefixSharingConfig
from ..cross_micro_batch import GroupSchedule, plan_group
from ..equivalence import RunOutputs, advantages, at_least_fp32
from .megatron import MicroBatchRun, full_grads

__all__ = ["CrossMicroBatchRun", "forward_backward_cross"]


@dataclasses.dataclass
class CrossMicroBatchRun:
    """A group's run over micro-batches: comparable outputs, and what it cost.

    Attributes:
        run: the group's outputs as one micro-batch's, and the gradients.
        schedule: the prefix and suffix micro-batches.
        held_bytes: prefix K/V leaves and their gradients held across the group (this rank).
        tokens_computed: tokens the model ran over all micro-batches.
    """

    run: MicroBatchRun
    schedule: GroupSchedule
    held_bytes: int
    tokens_computed: int

    def report(self) -> dict:
        """The figures ``verify`` / ``bench --cross-micro-batch`` print."""
        return {
            "num_micro_batches": self.schedule.num_micro_batches,
            "tokens_computed": self.tokens_computed,
            "tokens_unique": self.schedule.tokens_unique,
            "tokens_total": self.schedule.num_tokens_total,
            "prefix_len": self.schedule.prefix_len,
            "prefix_recomputes_avoided": self.schedule.prefix_recomputes_avoided,
            "held_bytes": self.held_bytes,
        }


def forward_backward_cross(
    model: torch.nn.Module,
    sequences: Sequence[torch.Tensor],
    token_budget: int,
    config: PrefixSharingConfig = PrefixSharingConfig(),
    *,
    recompute_prefix: bool = False,
) -> CrossMicroBatchRun:
    """Forward+backward of one group in micro-batches of at most ``token_budget`` computed
    tokens, its common prefix computed once (see
    :mod:`prefix_sharing.megatron_ext.cross_micro_batch`)."""
    from ..megatron_ext.cross_micro_batch import forward_backward_group

    schedule = plan_group(sequences, token_budget, config)
    device = next(model.parameters()).device
    total = schedule.num_tokens_total
    weights = advantages(total, seed=0).to(device)

    def token_loss(log_probs: torch.Tensor, entropy: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
        # pg_loss(all tokens) = sum over micro-batches of their tokens' terms
        picked = weights.index_select(0, positions)
        return (-(picked * log_probs).sum() - 0.01 * entropy.sum()) / total

    model.zero_grad(set_to_none=True)
    group = forward_backward_group(model, schedule, token_loss, recompute_prefix=recompute_prefix,
                                   backend=config.backend, keep_logits=True)
    outputs = RunOutputs(at_least_fp32(group.logits).cpu(), group.log_probs.cpu(),
                         group.entropy.cpu(), group.loss.cpu(), {})
    return CrossMicroBatchRun(MicroBatchRun([outputs], full_grads(model), []), schedule,
                              group.held_bytes, group.tokens_computed)
