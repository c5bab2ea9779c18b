"""A group across micro-batches under context parallelism: each micro-batch split over CP ranks.

Every micro-batch of a :class:`~prefix_sharing.group_schedule.GroupSchedule` - a shared
block or a suffix - is split as the context-parallel path splits one micro-batch
(:mod:`.context_parallel`): its own rows (padded to a multiple of CP, ``plan_group``'s
``pad_to_multiple_of``) in contiguous slices, one per rank, each rank's query pieces cut
from the plan's segments. Its plan addresses *external rows plus its own* (the stack of
blocks first), so the slice's ``kv_gather_index`` reads ``cat(stack's K/V, own gathered K/V)``.

The core attention all-gathers a micro-batch's own K/V over the CP group, then exchanges them
with the group's prefix store (:class:`~prefix_sharing.prefix_kv.PrefixKV`): a block records its
*gathered* K/V, so every rank keeps the whole block as leaves and every rank's suffix rows read
the whole prefix with no further communication; a suffix's backward accumulates its rank's dK/dV
into its rank's leaves. At the block's backward, those sums enter the recorded (gathered) K/V
and the gather's backward reduce-scatters them, so each rank's block rows get every rank's
readers' dK/dV: one all-gather per layer per block in the forward, one reduce-scatter in the
backward, as the block's own attention needs anyway. Held per rank: the whole prefix's leaves
and gradients (what CP=1 holds), not ``1 / CP`` of them.

Log-probs and entropy: each rank computes the positions that read its rows and one all-reduce
completes them (:func:`~.logprobs.context_parallel_token_stats`); the loss computed from the
complete vectors is the same on every rank and each rank back-propagates it into its own rows,
scaled by CP as megatron's schedule scales it, so averaging the gradients over the data x
context group (megatron's DDP; :func:`prefix_sharing.engines.megatron.finalize_context_parallel_grads`)
gives the group's gradient.
"""

from __future__ import annotations

import dataclasses

import torch

from ..logprobs import TokenStats, token_log_probs
from ..plan import SharingPlan
from .checks import assert_same_plan
from .context_parallel import ContextParallelSlice, slice_plan
from .logprobs import context_parallel_token_stats, vocab_shard
from .packed_seq import _context_parallel_group

__all__ = ["CrossSlice", "context_parallel_size", "slice_micro_batch", "model_inputs",
           "micro_batch_stats", "whole_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class CrossSlice:
    """This CP rank's part of one micro-batch of a group.

    Attributes:
        attention: the slice of the model's plan (external rows first), for the core attention.
        positions: the scoring plan's packed positions that read this rank's rows (int64).
    """

    attention: ContextParallelSlice
    positions: torch.Tensor


def context_parallel_size() -> int:
    """The context-parallel group's size (1 without megatron's parallel state)."""
    group = _context_parallel_group()
    return 1 if group is None else group.size()


def slice_micro_batch(plan: SharingPlan, scoring: SharingPlan, scored_rows: int,
                      device: torch.device) -> CrossSlice | None:
    """This rank's :class:`CrossSlice` of a micro-batch with model plan ``plan`` (host) whose
    tokens are scored by ``scoring`` (whose rows ``< scored_rows`` are the micro-batch's own
    rows); ``None`` without context parallelism. Checks that every CP rank holds the same plan."""
    group = _context_parallel_group()
    if group is None:
        return None
    assert_same_plan(plan, group)
    cp = slice_plan(plan, torch.distributed.get_rank(group), group.size(), group, device)
    rows = scoring.kv_index
    local = (rows >= cp.row_start) & (rows < min(cp.row_stop, scored_rows))
    return CrossSlice(cp, local.nonzero()[:, 0].to(device))


def model_inputs(plan: SharingPlan, cp: CrossSlice | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``GPTModel``'s ``input_ids`` and ``position_ids`` (``[1, T]``): this rank's rows."""
    rows = slice(None) if cp is None else slice(cp.attention.row_start, cp.attention.row_stop)
    return plan.input_ids[None, rows], plan.position_ids[None, rows]


def micro_batch_stats(logits: torch.Tensor, scoring: SharingPlan, cp: CrossSlice | None, *,
                      temperature: float, with_entropy: bool = True) -> TokenStats:
    """Every position of ``scoring`` (packed), on every rank, from this rank's logits rows
    (``scoring``'s rows, or under CP this rank's slice of them)."""
    shard = vocab_shard(logits.size(-1))
    if cp is None:
        return token_log_probs(logits, scoring, temperature=temperature,
                               with_entropy=with_entropy, vocab_shard=shard)
    return context_parallel_token_stats(
        logits, scoring, cp.positions, cp.attention.row_start, cp.attention.group,
        temperature=temperature, with_entropy=with_entropy, vocab_shard=shard)


def whole_rows(logits: torch.Tensor, cp: CrossSlice | None) -> torch.Tensor:
    """Every rank's logits rows, in order (for comparisons; no gradient)."""
    if cp is None:
        return logits
    group = cp.attention.group
    parts = [torch.empty_like(logits) for _ in range(group.size())]
    torch.distributed.all_gather(parts, logits.detach().contiguous(), group=group)
    return torch.cat(parts)
