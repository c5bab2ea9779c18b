"""Megatron self-attention whose rotary embedding uses each token's absolute position."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention

from .packed_seq import PlanPackedSeqParams

__all__ = ["PrefixSharingSelfAttention"]


class PrefixSharingSelfAttention(SelfAttention):
    """``SelfAttention`` that rotates every flat token at its true position.

    RoPE is applied here, before core attention, from a table indexed by position. Megatron's
    THD path restarts that index at 0 in every segment, but a reuser's tail starts at its prefix
    length; so for a planned micro-batch the table is replaced by one row per flat token
    (``plan.position_ids``), which Megatron's RoPE then applies token by token. Everything else
    is the stock ``SelfAttention``.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        *args: Any,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if rotary_pos_emb is not None and isinstance(packed_seq_params, PlanPackedSeqParams):
            if isinstance(rotary_pos_emb, tuple):  # separate query / key tables
                rotary_pos_emb = tuple(
                    None if t is None else packed_seq_params.per_token_rotary(t)
                    for t in rotary_pos_emb
                )
            else:
                rotary_pos_emb = packed_seq_params.per_token_rotary(rotary_pos_emb)
        return super().forward(
            hidden_states, *args, rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params, **kwargs,
        )
