"""Megatron self-attention whose rotary embedding uses each token's absolute position."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.attention import SelfAttention

from .checks import UnsupportedSetupError
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
        if isinstance(packed_seq_params, PlanPackedSeqParams):
            self._check_layout(hidden_states, packed_seq_params)
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

    def _check_layout(self, hidden_states: torch.Tensor, params: PlanPackedSeqParams) -> None:
        """Stages exchange only activations: a stage that planned another micro-batch would
        read them in the wrong layout. A different token count shows it at the first layer."""
        tokens = hidden_states.size(0)  # [s, b, h]; s is split across TP ranks under SP
        if self.config.sequence_parallel:
            tokens *= self.config.tensor_model_parallel_size
        if tokens != params.plan.num_tokens_flat:
            raise UnsupportedSetupError(
                f"this layer received {tokens} tokens but the micro-batch's plan lays out "
                f"{params.plan.num_tokens_flat}: were the pipeline stages given different plans?"
            )
