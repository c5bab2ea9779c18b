"""What one group's run across micro-batches produces, and how its micro-batches are scored.

Shared by the group driver (:mod:`.cross_micro_batch`), the executor (:mod:`.cross_steps`) and
verl's cross forward: a
block's pass (:class:`PrefixPass`), a suffix micro-batch's loss from its logits
(:func:`score_suffix`), the per-token outputs gathered over the group (:class:`Collector`,
:class:`GroupRun`). Each scores a micro-batch's rows through its plan; under context
parallelism from this rank's rows (:mod:`.cross_context_parallel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..cross_micro_batch import GroupSchedule, SharedBlock, SuffixMicroBatch
from ..prefix_kv import PrefixKV, PrefixKVStack
from .cross_context_parallel import (CrossSlice, micro_batch_stats,
                                     slice_micro_batch, whole_rows)
from .logprobs import vocab_shard
from .packed_seq import PlanPackedSeqParams
from .routing_replay import flat_routes

__all__ = ["Collector", "GroupRun", "PrefixPass", "TokenLoss", "score_suffix",
           "sequence_parallel_size", "suffix_routes"]

TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class GroupRun:
    """What one group's forward+backward produced (all detached).

    Attributes:
        log_probs, entropy: ``(T_total,)`` every token of the group, packed in given order.
        logits: ``(T_total, V)`` the same rows' logits (the whole vocabulary), when asked for
            (``keep_logits``).
        loss: the sum of the micro-batches' losses.
        held_bytes: the most K/V leaves and gradients held at once across the group (the
            live blocks'; with MoE router statistics, their router logits and gradients too).
        tokens_computed: tokens the model ran, over all micro-batches (a recomputed block
            counted twice).
        metrics: the schedule's figures (:meth:`GroupSchedule.metrics
            <prefix_sharing.group_schedule.GroupSchedule.metrics>`) and
            ``prefix_sharing/cross_held_bytes``.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor
    logits: torch.Tensor | None
    loss: torch.Tensor
    held_bytes: int
    tokens_computed: int
    metrics: dict[str, float]


def score_suffix(logits: torch.Tensor, suffix: SuffixMicroBatch, token_loss: TokenLoss,
                 out: Collector, temperature: float,
                 cp: CrossSlice | None = None) -> torch.Tensor:
    """A suffix micro-batch's loss from its logits (``[T, V]``; under CP this rank's rows,
    ``cp``), its outputs collected."""
    tail_plan = suffix.tail_plan.to(logits.device)
    stats = micro_batch_stats(logits, tail_plan, cp, temperature=temperature)
    positions = suffix.token_positions.to(logits.device)
    loss = token_loss(stats.log_probs, stats.entropy, positions)
    out.add(positions, stats.log_probs, stats.entropy, loss)
    out.add_logits(positions, lambda: tail_plan.restore(whole_rows(logits, cp)))
    return loss


class PrefixPass:
    """A shared block's micro-batch (by default the schedule's first: the whole common prefix
    of a one-level schedule): its rows after the K/V of the blocks it reads (pad rows after
    them), recording its own K/V."""

    def __init__(self, schedule: GroupSchedule, prefix_kv: PrefixKV | PrefixKVStack,
                 backend: str, temperature: float, device: torch.device, *,
                 block: SharedBlock | None = None) -> None:
        block = schedule.blocks[0] if block is None else block
        self.prefix_len = block.length
        self.cp = slice_micro_batch(block.plan, block.stats_plan, block.length, device)
        self.params = PlanPackedSeqParams.from_plan(block.plan.to(device), backend,
                                                    cp=self.cp and self.cp.attention,
                                                    prefix_kv=prefix_kv,
                                                    routes=_block_routes(block, device))
        self.block = block
        self.stats_plan = block.stats_plan.to(device)
        self.keep = block.scored_positions().to(device)
        self.positions = block.positions.to(device)
        self.num_sequences = len(block.members)
        self.temperature = temperature

    def stats_of(self, logits: torch.Tensor,
                 with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None,
                                                     Callable[[], torch.Tensor]]:
        """From this pass's output ``logits`` (``[rows, V]``; under CP this rank's rows), every
        member's log-probs and entropy at the block's positions (``(N * length,)`` each,
        member-major: the block's ``positions``' order), and a callable giving those
        positions' logits."""
        # under CP this rank's rows, its positions those that read its block rows
        rows = logits if self.cp is not None else self.block.scored_rows(logits)
        stats = micro_batch_stats(rows, self.stats_plan, self.cp, temperature=self.temperature,
                                  with_entropy=with_entropy)
        log_probs = stats.log_probs.index_select(0, self.keep)
        entropy = stats.entropy.index_select(0, self.keep) if with_entropy else None
        return log_probs, entropy, lambda: self.stats_plan.restore(
            self.block.scored_rows(whole_rows(logits, self.cp))).index_select(0, self.keep)


class Collector:
    """Assembles the group's per-token outputs from its micro-batches."""

    def __init__(self, total: int, device: torch.device, keep_logits: bool) -> None:
        self.log_probs = torch.zeros(total, device=device)
        self.entropy = torch.zeros(total, device=device)
        self.logits: torch.Tensor | None = None
        self.keep_logits = keep_logits
        self.loss = torch.zeros((), device=device)
        self.total = total

    def add(self, positions: torch.Tensor, log_probs: torch.Tensor, entropy: torch.Tensor,
            loss: torch.Tensor) -> None:
        self.log_probs = self.log_probs.to(log_probs.dtype)
        self.entropy = self.entropy.to(entropy.dtype)
        self.log_probs[positions] = log_probs.detach()
        self.entropy[positions] = entropy.detach()
        self.loss = self.loss + loss.detach()

    def add_logits(self, positions: torch.Tensor, logits: Callable[[], torch.Tensor]) -> None:
        """The logits at ``positions`` (called only when kept)."""
        if self.keep_logits:
            rows = _whole_vocab(logits().detach())
            if self.logits is None:
                self.logits = rows.new_zeros(self.total, rows.size(1))
            self.logits[positions] = rows

    def result(self, held_bytes: int, tokens_computed: int,
               metrics: dict[str, float]) -> GroupRun:
        return GroupRun(self.log_probs, self.entropy, self.logits, self.loss, held_bytes,
                        tokens_computed, metrics)


def _block_routes(block: SharedBlock, device: torch.device) -> torch.Tensor | None:
    """The routes a block's flat rows replay: its tokens', then its pad rows' (nobody reads
    them: the first row's, as :func:`~.routing_replay.flat_routes` gives pad rows)."""
    if block.routes is None:
        return None
    pad = block.plan.num_tokens_flat - block.length
    return torch.cat([block.routes, block.routes[:1].expand(pad, -1, -1)]).to(device)


def suffix_routes(suffix: SuffixMicroBatch, device: torch.device) -> torch.Tensor | None:
    """The routes a suffix micro-batch's flat rows replay (its tails', as it was planned with
    them), or None without routing replay."""
    if suffix.routes is None:
        return None
    return flat_routes(suffix.tail_plan, suffix.routes, device)


def _whole_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Every rank's vocabulary slice side by side (for comparisons; no gradient)."""
    if vocab_shard(logits.size(-1)) is None:
        return logits
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def sequence_parallel_size(model: torch.nn.Module) -> int:
    """The number of ranks a micro-batch's rows are split over (1 without sequence
    parallelism)."""
    if not get_attr_wrapped_model(model, "config").sequence_parallel:
        return 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
