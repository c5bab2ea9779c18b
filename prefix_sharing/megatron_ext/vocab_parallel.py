"""Token statistics over vocab-parallel logits: the tensor-parallel vocabulary slice and the
context-parallel completion of every position's log-probs.

Under tensor parallelism each rank holds a slice of the vocabulary; the per-row shift, softmax
denominator, expected logit and picked target logit are all-reduced across the tensor-parallel
group (:class:`MegatronVocabShard`). Under context parallelism each rank holds the logits of
its slice of the flat rows: it computes the positions that read those rows, and one all-reduce
over the CP group (of two ``(T_total,)`` vectors, each position filled by exactly one rank)
completes them on every rank (:func:`context_parallel_token_stats`). Its backward is the
identity: the loss computed from the complete vectors is the same on every CP rank, so each
rank back-propagates into its own rows, and the CP-replicated parameters' gradients are then
reduced over the group as megatron's ``finalize_model_grads`` does.

The leaf under :mod:`.logprobs` (the model-level scoring) and :mod:`.mtp` (the MTP depths).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from ..logprobs import TokenStats, token_log_probs
from ..plan import SharingPlan
from .context_parallel import ContextParallelSlice

__all__ = ["MegatronVocabShard", "context_parallel_token_stats", "rows_token_stats",
           "vocab_shard"]


class MegatronVocabShard:
    """This tensor-parallel rank's vocabulary slice, as :class:`prefix_sharing.logprobs.VocabShard`.

    Plain all-reduces: ``token_log_probs`` reduces outside autograd and derives its backward
    from the reduced statistics, so Megatron's autograd-aware region mappings are not needed.
    """

    def __init__(self, vocab_per_rank: int, group: torch.distributed.ProcessGroup) -> None:
        self.group = group
        self.vocab_start = torch.distributed.get_rank(group) * vocab_per_rank

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(x, torch.distributed.ReduceOp.SUM)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(x, torch.distributed.ReduceOp.MAX)

    def _all_reduce(self, x: torch.Tensor, op: torch.distributed.ReduceOp) -> torch.Tensor:
        x = x.detach().clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(x, op=op, group=self.group)
        return x


def context_parallel_token_stats(
    logits: torch.Tensor,
    plan: SharingPlan,
    positions: torch.Tensor,
    row_start: int,
    group: torch.distributed.ProcessGroup,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_shard: MegatronVocabShard | None = None,
    targets: torch.Tensor | None = None,
) -> TokenStats:
    """Every position's log-probs and entropy (``(T_total,)``, packed in ``plan``'s order) on
    every rank of the CP ``group``, from this rank's logits ``[T_local, V_local]`` (the plan's
    rows ``row_start ..``): this rank computes ``positions`` (those that read its rows; each
    position computed by exactly one rank) and one all-reduce completes them (the module doc).
    ``targets``: as :func:`prefix_sharing.logprobs.token_log_probs` takes them."""
    local = token_log_probs(
        logits, plan, temperature=temperature, with_entropy=with_entropy,
        vocab_shard=vocab_shard, positions=positions, row_start=row_start, targets=targets,
    )
    stats = [s for s in local if s is not None]
    packed = torch.zeros(len(stats), plan.num_tokens_total, dtype=stats[0].dtype,
                         device=stats[0].device)
    packed = packed.index_copy(1, positions, torch.stack(stats))  # [1 or 2, T_total]
    packed = _SumOverContextParallel.apply(packed, group)
    return TokenStats(packed[0], packed[1] if with_entropy else None)


class _SumOverContextParallel(torch.autograd.Function):
    """All-reduce (sum) over the CP group; the backward passes the gradient through, since
    every CP rank computes the same loss from the summed result (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def vocab_shard(vocab_per_rank: int) -> MegatronVocabShard | None:
    """This rank's vocabulary slice when the tensor-parallel group splits the logits, else None."""
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
        if torch.distributed.get_world_size(group) > 1:
            return MegatronVocabShard(vocab_per_rank, group)
    return None


def rows_token_stats(
    logits: torch.Tensor,
    plan: SharingPlan,
    cp: ContextParallelSlice | None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_shard: MegatronVocabShard | None = None,
    targets: torch.Tensor | None = None,
) -> TokenStats:
    """Every position's log-probs (and entropy) from this rank's logits ``[T_flat (/ CP),
    V_local]`` of ``plan``'s rows: :func:`prefix_sharing.logprobs.token_log_probs` over all of
    them, or under context parallelism (``cp``, this rank's slice) its rows' positions and
    :func:`context_parallel_token_stats`'s completion. ``targets``: as ``token_log_probs``
    takes them."""
    if cp is None:
        return token_log_probs(logits, plan, temperature=temperature, with_entropy=with_entropy,
                               vocab_shard=vocab_shard, targets=targets)
    return context_parallel_token_stats(
        logits, plan, cp.token_positions, cp.row_start, cp.group, temperature=temperature,
        with_entropy=with_entropy, vocab_shard=vocab_shard, targets=targets)
