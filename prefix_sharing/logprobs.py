"""Per-token log-probabilities and entropy straight from the flat logits.

The flat logits hold one row per *computed* token. Every packed position ``(r, t)`` reads its
row through ``plan.kv_index``; a row that several sequences share is normalised once and then
gathered at each sequence's own next token. Nothing of size ``(T_total, vocab)`` is built.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .plan import SharingPlan

__all__ = ["TokenStats", "token_log_probs"]


class TokenStats(NamedTuple):
    """``(T_total,)`` fp32 tensors, packed per sequence in the plan's order.

    ``log_probs[(r, t)] = log p(x[r, t+1] | x[r, :t+1])`` (0 at each sequence's last position,
    which predicts nothing); ``entropy[(r, t)]`` is the entropy of that next-token distribution.
    This is the layout verl and Megatron use (value at ``t`` scores token ``t + 1``).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


def token_log_probs(
    flat_logits: torch.Tensor,
    plan: SharingPlan,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> TokenStats:
    """Log-probs (and entropy) of every sequence's tokens from ``(T_flat, vocab)`` logits.

    Args:
        flat_logits: ``(T_flat, vocab)`` logits of the plan's flat layout (any float dtype;
            computed in fp32).
        plan: the plan the logits were computed with (on the logits' device).
        temperature: logits are divided by it first, as verl does for rollout parity.
        with_entropy: also return the entropy (costs one more ``(T_flat, vocab)`` product).
    """
    if flat_logits.dim() != 2 or flat_logits.size(0) != plan.num_tokens_flat:
        raise ValueError(
            f"flat_logits must be (T_flat={plan.num_tokens_flat}, vocab); "
            f"got {tuple(flat_logits.shape)}"
        )
    logp = torch.log_softmax(flat_logits.float() / temperature, dim=-1)  # [T_flat, V]
    rows = plan.kv_index
    log_probs = logp[rows, plan.next_token_ids].masked_fill(plan.is_last_token, 0.0)
    entropy = None
    if with_entropy:
        entropy = -(logp.exp() * logp).sum(-1).index_select(0, rows)
    return TokenStats(log_probs, entropy)
