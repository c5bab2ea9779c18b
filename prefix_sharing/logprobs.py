"""Per-token log-probabilities and entropy straight from the flat logits.

The flat logits hold one row per *computed* token. Every packed position ``(r, t)`` reads its
row through ``plan.kv_index``; a row that several sequences share is normalised once and then
gathered at each sequence's own next token. Nothing of size ``(T_total, vocab)`` is built.

Under tensor parallelism the vocabulary is split across ranks. The same arithmetic then needs
three reductions over the shards (a max, the softmax denominator, the picked target logit);
they come from a :class:`VocabShard`, so this module stays free of ``torch.distributed``
(``prefix_sharing.megatron_ext`` supplies Megatron's).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from .plan import SharingPlan

__all__ = ["TokenStats", "VocabShard", "token_log_probs"]


class TokenStats(NamedTuple):
    """``(T_total,)`` fp32 tensors, packed per sequence in the plan's order.

    ``log_probs[(r, t)] = log p(x[r, t+1] | x[r, :t+1])`` (0 at each sequence's last position,
    which predicts nothing); ``entropy[(r, t)]`` is the entropy of that next-token distribution.
    This is the layout verl and Megatron use (value at ``t`` scores token ``t + 1``).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class VocabShard(Protocol):
    """This rank's slice ``[vocab_start, vocab_start + V_local)`` of a vocabulary split by rank."""

    vocab_start: int

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the shards; differentiable (the gradient of a shared sum is the identity)."""

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Max over the shards; used only as a stabilising shift, so no gradient."""


class _WholeVocab:
    vocab_start = 0

    @staticmethod
    def sum(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def max(x: torch.Tensor) -> torch.Tensor:
        return x


def token_log_probs(
    flat_logits: torch.Tensor,
    plan: SharingPlan,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_shard: VocabShard | None = None,
) -> TokenStats:
    """Log-probs (and entropy) of every sequence's tokens from ``(T_flat, vocab)`` logits.

    Args:
        flat_logits: ``(T_flat, vocab)`` logits of the plan's flat layout (any float dtype;
            computed in fp32). With ``vocab_shard``: this rank's ``(T_flat, V_local)`` slice.
        plan: the plan the logits were computed with (on the logits' device).
        temperature: logits are divided by it first, as verl does for rollout parity.
        with_entropy: also return the entropy (one more ``(T_flat, vocab)`` product).
        vocab_shard: the reductions over a vocabulary split across ranks; ``None`` when
            ``flat_logits`` holds the whole vocabulary.
    """
    if flat_logits.dim() != 2 or flat_logits.size(0) != plan.num_tokens_flat:
        raise ValueError(
            f"flat_logits must be (T_flat={plan.num_tokens_flat}, vocab); "
            f"got {tuple(flat_logits.shape)}"
        )
    shard = _WholeVocab() if vocab_shard is None else vocab_shard
    logits = flat_logits.float()  # [T_flat, V_local]
    if temperature != 1.0:
        logits = logits / temperature
    shift = shard.max(logits.detach().amax(dim=-1))  # [T_flat]
    shifted = logits - shift[:, None]
    exp = shifted.exp()
    denominator = shard.sum(exp.sum(dim=-1))  # [T_flat]
    log_denominator = denominator.log()  # lse = shift + log_denominator

    rows = plan.kv_index  # [T_total]: the flat row of every packed position
    local_target = plan.next_token_ids - shard.vocab_start
    in_shard = (local_target >= 0) & (local_target < logits.size(-1))
    picked = shifted[rows, local_target.clamp(0, logits.size(-1) - 1)].masked_fill(~in_shard, 0.0)
    log_probs = shard.sum(picked) - log_denominator.index_select(0, rows)
    log_probs = log_probs.masked_fill(plan.is_last_token, 0.0)

    entropy = None
    if with_entropy:
        # H = lse - E[logit] = log_denominator - E[shifted]
        expected_shifted = shard.sum((exp * shifted).sum(dim=-1)) / denominator
        entropy = (log_denominator - expected_shifted).index_select(0, rows)
    return TokenStats(log_probs, entropy)
