"""Megatron self-attention whose rotary embedding uses each token's absolute position."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import Attention, SelfAttention

from ..refusals import refuse
from .checks import UnsupportedSetupError
from .core_attention import require_sharing_core_attention
from .packed_seq import PlanPackedSeqParams

__all__ = ["PrefixSharingSelfAttention", "check_planned_call", "planned_call"]

_FORWARD_SIGNATURE = inspect.signature(Attention.forward)
RotaryTables = tuple[torch.Tensor | None, torch.Tensor | None]


class PrefixSharingSelfAttention(SelfAttention):
    """``SelfAttention`` that rotates every flat token at its true position.

    Megatron's THD RoPE restarts the position at 0 in every segment, but a reuser's tail starts
    at its prefix length. So for a planned micro-batch this layer applies RoPE itself, right
    where megatron would (after the QKV projection and any Q/K norms, before core attention):
    the table becomes one row per flat token (``plan.position_ids``), and megatron's own
    ``apply_rotary_pos_emb`` rotates ``[T, 1, heads, dim]`` as one BSHD batch - the same math
    (``rotary_interleaved``, partial ``rotary_percent``, YaRN ``mscale``, TE's fused kernel
    under ``apply_rope_fusion``) with no per-segment loop and no device-to-host read. Megatron
    then runs with ``rotary_pos_emb=None``. Without a plan everything is the stock
    ``SelfAttention``.
    """

    _token_rotary: RotaryTables | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_sharing_core_attention(self)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        planned = planned_call(_FORWARD_SIGNATURE, self, args, kwargs)
        if planned is None:
            return super().forward(*args, **kwargs)
        call, params = planned
        tables = call.arguments.get("rotary_pos_emb")
        if tables is not None and not self._rope_skipped():
            self._token_rotary = _per_token_tables(params, tables)
        call.arguments["rotary_pos_emb"] = None
        try:
            return super().forward(*call.args[1:], **call.kwargs)
        finally:
            self._token_rotary = None

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        """Megatron's Q/K/V, rotated at the tokens' absolute positions for a planned batch.

        Packed batches always take the split path (``[T, 1, heads, dim]`` q, k, v, and the
        output gate when configured), so only that shape is handled.
        """
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        if self._token_rotary is None:
            return qkv
        query, key, *rest = qkv
        q_table, k_table = self._token_rotary
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        # no cu_seqlens: megatron's BSHD path, one elementwise rotation
        rope = dict(config=self.config, mscale=mscale, cp_group=self.pg_collection.cp)
        if q_table is not None:
            query = apply_rotary_pos_emb(query, q_table, **rope)
        if k_table is not None:
            key = apply_rotary_pos_emb(key, k_table, **rope)
        return (query, key, *rest)

    def _rope_skipped(self) -> bool:
        """Megatron's ``no_rope_freq``: layers that take no rotary embedding at all."""
        no_rope = self.config.no_rope_freq
        return bool(no_rope and no_rope[self.layer_number - 1])


def planned_call(signature: inspect.Signature, layer: Any, args: tuple, kwargs: dict[str, Any]
                 ) -> tuple[inspect.BoundArguments, PlanPackedSeqParams] | None:
    """The attention forward's call bound to ``signature`` (``layer`` as ``self``) and its
    plan's params, checked (:func:`check_planned_call`); ``None`` when the call carries no
    plan, and the layer is megatron's stock one."""
    call = signature.bind(layer, *args, **kwargs)
    params = call.arguments.get("packed_seq_params")
    if not isinstance(params, PlanPackedSeqParams):
        return None
    check_planned_call(layer.config, call.arguments, params)
    return call, params


def check_planned_call(config: Any, arguments: dict[str, Any], params: PlanPackedSeqParams) -> None:
    """Refuses a planned attention call that sharing cannot serve: a KV cache, or hidden states
    laid out for another plan (stages exchange only activations, so a stage that planned another
    micro-batch would read them in the wrong layout; a different token count shows it at the
    first layer). ``arguments`` are the attention forward's bound arguments."""
    inference = (arguments.get(n) for n in ("inference_context", "inference_params"))
    if any(i is not None for i in inference):
        raise refuse("megatron.inference_context", "inference_context", error=UnsupportedSetupError)
    tokens = arguments["hidden_states"].size(0)  # [s, b, h]; s is split across TP ranks under SP
    if config.sequence_parallel:
        tokens *= config.tensor_model_parallel_size
    tokens *= config.context_parallel_size  # each CP rank holds a slice of the rows
    if tokens != params.plan.num_tokens_flat:
        raise refuse("megatron.plan_mismatch",
                     f"this layer received {tokens} tokens but the micro-batch's plan lays out "
                     f"{params.plan.num_tokens_flat}", error=UnsupportedSetupError)



def _per_token_tables(
    params: PlanPackedSeqParams, tables: torch.Tensor | tuple[torch.Tensor | None, ...]
) -> RotaryTables:
    """The query and key tables, one row per flat token (megatron passes one table for both
    or a ``(query, key)`` pair)."""
    q_table, k_table = tables if isinstance(tables, tuple) else (tables, tables)
    return (
        None if q_table is None else params.per_token_rotary(q_table),
        None if k_table is None else params.per_token_rotary(k_table),
    )
