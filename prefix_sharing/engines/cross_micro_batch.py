"""The Megatron engine's cross-micro-batch run: a batch's groups over token-budget micro-batches.

Each group (by default the whole batch) runs as its shared blocks (its prefix, chunked when
longer than the budget, and its sub-trees' shared parts) plus suffix micro-batches (:func:`~prefix_sharing.cross_micro_batch.plan_group`); gradients accumulate over
all groups. Its reference is the stock step on the same split: the *plain micro-batches*, one
per suffix micro-batch, each holding that suffix's samples whole (:attr:`CrossMicroBatchRun.
plain_split`), run through megatron's schedule by :func:`~.megatron.forward_backward`. That is
the split a trainer's stock step would run these samples in, and it decides the MoE router's
batch statistics (each micro-batch's aux / z-losses are its own; see
:mod:`prefix_sharing.megatron_ext.cross_micro_batch`). The loss is the one
:func:`~.megatron.forward_backward` gives that split - per plain micro-batch ``j``
:func:`~prefix_sharing.equivalence.pg_loss` with the seeded advantages of micro-batch ``j``,
divided by the number of micro-batches as megatron's schedule does - written as per-token
terms so that each cross micro-batch scores its own tokens; so the result compares with
:func:`~.megatron.compare` against that run, micro-batch by micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config import PrefixSharingConfig
from ..cross_micro_batch import GroupSchedule, plan_group
from ..equivalence import RunOutputs, advantages, at_least_fp32
from ..planner import build_plan
from .megatron import (MicroBatchRun, finalize_context_parallel_grads,
                       finalize_sequence_parallel_grads, full_grads)

__all__ = ["CrossMicroBatchRun", "forward_backward_cross", "plan_cross"]


@dataclasses.dataclass
class CrossMicroBatchRun:
    """A batch's run over micro-batches: comparable outputs, and what it cost.

    Attributes:
        run: the batch's outputs per plain micro-batch (``plain_split``), and the gradients
            (None when not collected).
        schedules: each group's prefix and suffix micro-batches.
        plain_split: the batch indices of each plain micro-batch (one per suffix micro-batch,
            groups in order): what the reference runs as its micro-batches.
        held_bytes: the most K/V (leaves and gradients; with MoE router statistics, the
            router logits' too) held at once across a group.
        tokens_computed: tokens the model ran over all micro-batches.
        tokens_unique: tokens the whole batch's single plan computes.
        recomputed_tokens: tokens computed more than once (``cross_recomputed_tokens``).
        max_tokens_computed: the largest micro-batch's computed tokens.
    """

    run: MicroBatchRun | None
    schedules: list[GroupSchedule]
    plain_split: list[list[int]]
    held_bytes: int
    tokens_computed: int
    tokens_unique: int
    recomputed_tokens: int
    max_tokens_computed: int

    def report(self) -> dict:
        """The figures ``verify --token-budget`` prints."""
        return {
            "num_micro_batches": sum(s.num_micro_batches for s in self.schedules),
            "num_shared_blocks": sum(len(s.blocks) for s in self.schedules),
            "tokens_computed": self.tokens_computed,
            "max_tokens_computed": self.max_tokens_computed,
            "tokens_unique": self.tokens_unique,
            "tokens_total": sum(s.num_tokens_total for s in self.schedules),
            "prefix_lens": [s.prefix_len for s in self.schedules],
            "prefix_recomputes_avoided": sum(s.prefix_recomputes_avoided for s in self.schedules),
            "recomputed_tokens": self.recomputed_tokens,
            "held_bytes": self.held_bytes,
        }


def forward_backward_cross(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    sequences: Sequence[torch.Tensor],
    token_budget: int,
    config: PrefixSharingConfig = PrefixSharingConfig(),
    *,
    groups: Sequence[Sequence[int]] | None = None,
    recompute_prefix: bool = False,
    collect: bool = True,
    routes: Sequence[torch.Tensor] | None = None,
) -> CrossMicroBatchRun:
    """Forward+backward of a batch, each group in micro-batches of at most ``token_budget``
    computed tokens with its common prefix computed once (see
    :mod:`prefix_sharing.megatron_ext.cross_micro_batch`).

    Args:
        model: this rank's stage, or under interleaved pipeline stages its model chunks.
        groups: the members of each group (every sequence in exactly one); the whole batch
            as one group when omitted.
        recompute_prefix: see :func:`~prefix_sharing.megatron_ext.cross_micro_batch.
            forward_backward_group`.
        collect: gather the outputs and gradients for a comparison (off for timing).
        routes: recorded MoE routes to replay, one ``[L_i, moe_layers, topk]`` tensor per
            sequence (the model built with ``moe_enable_routing_replay=True``): each group is
            cut on tokens and routes, and every block and suffix replays its rows' routes;
            the reference replays them on the plain micro-batches
            (:func:`~.megatron.forward_backward`'s ``routes``, per ``plain_split`` entry).
    """
    from megatron.core import parallel_state

    from ..megatron_ext.cross_micro_batch import forward_backward_group

    chunks = list(model) if isinstance(model, Sequence) else [model]
    device = next(chunks[0].parameters()).device
    # under sequence parallelism each micro-batch's rows split over the tensor-parallel ranks,
    # under context parallelism over the CP ranks
    multiple = (parallel_state.get_tensor_model_parallel_world_size()
                if chunks[0].config.sequence_parallel else 1)
    multiple *= parallel_state.get_context_parallel_world_size()
    groups, schedules, split = plan_cross(sequences, token_budget, config, groups, multiple,
                                          routes=routes)
    starts = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    total = int(starts[-1])
    terms = _SplitLoss(split, starts, device)
    log_probs = torch.zeros(total)
    entropy = torch.zeros(total)
    logits: torch.Tensor | None = None
    held, computed, recomputed = 0, 0, 0
    outputs_here = parallel_state.is_pipeline_last_stage()
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    for members, schedule in zip(groups, schedules):
        # group-packed position -> batch-packed position
        where = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members]).to(device)
        group = forward_backward_group(
            chunks, schedule, lambda lp, ent, positions, where=where: terms(lp, ent, where[positions]),
            recompute_prefix=recompute_prefix, backend=config.backend, keep_logits=collect,
            aux_loss_scale=1 / len(split))
        held, computed = max(held, group.held_bytes), computed + group.tokens_computed
        recomputed += int(group.metrics["prefix_sharing/cross_recomputed_tokens"])
        if not (collect and outputs_here):
            continue
        rows = where.cpu()
        log_probs[rows], entropy[rows] = group.log_probs.cpu(), group.entropy.cpu()
        group_logits = at_least_fp32(group.logits).cpu()
        if logits is None:
            logits = group_logits.new_zeros(total, group_logits.size(1))
        logits[rows] = group_logits
    unique = build_plan(sequences, config, routes=routes).num_tokens_unique
    run = None
    if collect:
        outputs = []  # on the last pipeline stage
        for j, batch in enumerate(split if outputs_here else []):
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in batch])
            outputs.append(RunOutputs(logits[rows], log_probs[rows], entropy[rows],
                                      terms.loss(j).cpu(), {}))
        grads = {}
        for chunk in chunks:  # as forward_backward does
            finalize_sequence_parallel_grads(chunk)
            finalize_context_parallel_grads(chunk)
            grads.update(full_grads(chunk))
        run = MicroBatchRun(outputs, grads, [])
    largest = max(s.max_tokens_computed for s in schedules)
    return CrossMicroBatchRun(run, schedules, split, held, computed, unique, recomputed, largest)


def plan_cross(
    sequences: Sequence[torch.Tensor],
    token_budget: int,
    config: PrefixSharingConfig,
    groups: Sequence[Sequence[int]] | None = None,
    pad_to_multiple_of: int = 1,
    *,
    routes: Sequence[torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[GroupSchedule], list[list[int]]]:
    """The groups (the whole batch when omitted), each group's schedule, and the plain split
    (:attr:`CrossMicroBatchRun.plain_split`) of :func:`forward_backward_cross`; host work.
    ``routes``: per sequence, the routes to replay."""
    groups = [list(range(len(sequences)))] if groups is None else [list(g) for g in groups]
    if sorted(i for g in groups for i in g) != list(range(len(sequences))):
        raise ValueError("groups must hold every sequence exactly once")
    schedules = [plan_group([sequences[i] for i in members], token_budget, config,
                            pad_to_multiple_of=pad_to_multiple_of,
                            routes=None if routes is None else [routes[i] for i in members])
                 for members in groups]
    split = [[members[m] for m in suffix.members]
             for members, schedule in zip(groups, schedules) for suffix in schedule.suffixes]
    return groups, schedules, split


class _SplitLoss:
    """The loss :func:`~.megatron.forward_backward` gives the plain micro-batches ``split``,
    as per-token terms: token ``t`` of plain micro-batch ``j`` (``n_j`` tokens, ``M``
    micro-batches) weighs ``-a_t / (n_j M)`` on its log-prob and ``-0.01 / (n_j M)`` on its
    entropy, ``a`` the seeded advantages of micro-batch ``j``. Each call scores the tokens at
    the given batch-packed positions and adds their terms to their micro-batch's loss."""

    def __init__(self, split: list[list[int]], starts: torch.Tensor,
                 device: torch.device) -> None:
        total, count = int(starts[-1]), len(split)
        self.on_log_prob = torch.zeros(total)
        self.on_entropy = torch.zeros(total)
        self.micro_batch = torch.zeros(total, dtype=torch.int64)
        for j, batch in enumerate(split):
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in batch])
            n = rows.numel()
            self.on_log_prob[rows] = -advantages(n, seed=j) / (n * count)
            self.on_entropy[rows] = -0.01 / (n * count)
            self.micro_batch[rows] = j
        self.on_log_prob, self.on_entropy, self.micro_batch = (
            t.to(device) for t in (self.on_log_prob, self.on_entropy, self.micro_batch))
        self.sums = torch.zeros(count, dtype=torch.float64, device=device)

    def __call__(self, log_probs: torch.Tensor, entropy: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        terms = (self.on_log_prob.index_select(0, positions).to(log_probs.dtype) * log_probs
                 + self.on_entropy.index_select(0, positions).to(entropy.dtype) * entropy)
        self.sums.index_add_(0, self.micro_batch.index_select(0, positions),
                             terms.detach().double())
        return terms.sum()

    def loss(self, j: int) -> torch.Tensor:
        """Plain micro-batch ``j``'s loss as :func:`~.megatron.forward_backward` records it
        (before the schedule divides it by the number of micro-batches)."""
        return (self.sums[j] * self.sums.numel()).float()
