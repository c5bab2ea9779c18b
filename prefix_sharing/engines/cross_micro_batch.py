"""The Megatron engine's cross-micro-batch run: a batch's groups over token-budget micro-batches.

The same loss as :func:`~.megatron.forward_backward` gives the whole batch as one micro-batch
(:func:`~prefix_sharing.equivalence.pg_loss` with the seeded advantages of micro-batch 0),
written as its per-token terms so that each micro-batch scores its own tokens; so the result
compares with :func:`~.megatron.compare` against any one-micro-batch run of the batch. Each
group (by default the whole batch) runs as its prefix micro-batch plus suffix micro-batches
(:func:`~prefix_sharing.cross_micro_batch.plan_group`); gradients accumulate over all groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config import PrefixSharingConfig
from ..cross_micro_batch import GroupSchedule, plan_group
from ..equivalence import RunOutputs, advantages, at_least_fp32
from ..planner import build_plan
from .megatron import MicroBatchRun, full_grads

__all__ = ["CrossMicroBatchRun", "forward_backward_cross"]


@dataclasses.dataclass
class CrossMicroBatchRun:
    """A batch's run over micro-batches: comparable outputs, and what it cost.

    Attributes:
        run: the batch's outputs as one micro-batch's, and the gradients (None when not
            collected).
        schedules: each group's prefix and suffix micro-batches.
        held_bytes: the largest prefix K/V (leaves and gradients) held across a group.
        tokens_computed: tokens the model ran over all micro-batches.
        tokens_unique: tokens the whole batch's single plan computes.
    """

    run: MicroBatchRun | None
    schedules: list[GroupSchedule]
    held_bytes: int
    tokens_computed: int
    tokens_unique: int

    def report(self) -> dict:
        """The figures ``verify --token-budget`` prints."""
        return {
            "num_micro_batches": sum(s.num_micro_batches for s in self.schedules),
            "tokens_computed": self.tokens_computed,
            "max_tokens_computed": max(
                max([s.prefix_len] + [m.plan.num_tokens_unique for m in s.suffixes])
                for s in self.schedules),
            "tokens_unique": self.tokens_unique,
            "tokens_total": sum(s.num_tokens_total for s in self.schedules),
            "prefix_lens": [s.prefix_len for s in self.schedules],
            "prefix_recomputes_avoided": sum(s.prefix_recomputes_avoided for s in self.schedules),
            "held_bytes": self.held_bytes,
        }


def forward_backward_cross(
    model: torch.nn.Module,
    sequences: Sequence[torch.Tensor],
    token_budget: int,
    config: PrefixSharingConfig = PrefixSharingConfig(),
    *,
    groups: Sequence[Sequence[int]] | None = None,
    recompute_prefix: bool = False,
    collect: bool = True,
) -> CrossMicroBatchRun:
    """Forward+backward of a batch, each group in micro-batches of at most ``token_budget``
    computed tokens with its common prefix computed once (see
    :mod:`prefix_sharing.megatron_ext.cross_micro_batch`).

    Args:
        groups: the members of each group (every sequence in exactly one); the whole batch
            as one group when omitted.
        recompute_prefix: see :func:`~prefix_sharing.megatron_ext.cross_micro_batch.
            forward_backward_group`.
        collect: gather the outputs and gradients for a comparison (off for timing).
    """
    from ..megatron_ext.cross_micro_batch import forward_backward_group

    groups = [list(range(len(sequences)))] if groups is None else [list(g) for g in groups]
    if sorted(i for g in groups for i in g) != list(range(len(sequences))):
        raise ValueError("groups must hold every sequence exactly once")
    device = next(model.parameters()).device
    starts = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    total = int(starts[-1])
    weights = advantages(total, seed=0).to(device)
    log_probs = torch.zeros(total)
    entropy = torch.zeros(total)
    logits: torch.Tensor | None = None
    loss = torch.zeros(())
    schedules, held, computed = [], 0, 0
    model.zero_grad(set_to_none=True)
    for members in groups:
        schedule = plan_group([sequences[i] for i in members], token_budget, config)
        # group-packed position -> batch-packed position
        where = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members]).to(device)

        def token_loss(lp: torch.Tensor, ent: torch.Tensor, positions: torch.Tensor,
                       where: torch.Tensor = where) -> torch.Tensor:
            # pg_loss(all tokens) = the sum over micro-batches of their tokens' terms
            picked = weights.index_select(0, where.index_select(0, positions))
            return (-(picked * lp).sum() - 0.01 * ent.sum()) / total

        group = forward_backward_group(model, schedule, token_loss,
                                       recompute_prefix=recompute_prefix,
                                       backend=config.backend, keep_logits=collect)
        schedules.append(schedule)
        held, computed = max(held, group.held_bytes), computed + group.tokens_computed
        if not collect:
            continue
        rows = where.cpu()
        log_probs[rows], entropy[rows] = group.log_probs.cpu(), group.entropy.cpu()
        group_logits = at_least_fp32(group.logits).cpu()
        if logits is None:
            logits = group_logits.new_zeros(total, group_logits.size(1))
        logits[rows] = group_logits
        loss = loss + group.loss.cpu()
    unique = build_plan(sequences, config).num_tokens_unique
    run = None
    if collect:
        outputs = RunOutputs(logits, log_probs, entropy, loss, {})
        run = MicroBatchRun([outputs], full_grads(model), [])
    return CrossMicroBatchRun(run, schedules, held, computed, unique)
