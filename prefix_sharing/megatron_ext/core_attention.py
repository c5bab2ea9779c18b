"""Megatron core attention that injects each reuser's prefix K/V from its provider's rows."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from ..attention import prefix_attention, varlen_attention
from .checks import UnsupportedSetupError, check_layer_config, check_sharing_allowed
from .packed_seq import PlanPackedSeqParams

__all__ = ["PrefixSharingCoreAttention"]


class PrefixSharingCoreAttention(DotProductAttention):
    """Core attention for packed (THD) micro-batches, with prefix sharing.

    Shapes (this tensor-parallel rank's heads; ``T`` = flat tokens of the micro-batch):
        query ``[T, np, hn]``, key/value ``[T, ng, hn]`` -> output ``[T, np * hn]``.

    With a :class:`PlanPackedSeqParams`, every query segment attends to its whole sequence: its
    provider's prefix rows are gathered into the segment's keys and values (``kv_gather_index``),
    causal aligned bottom-right. With Megatron's plain ``PackedSeqParams`` it is ordinary THD
    attention, and without packed params it is Megatron's own ``DotProductAttention``.

    Constructed by ``build_module`` with megatron-core's core-attention keywords; register it
    through :func:`prefix_sharing.megatron_ext.with_prefix_sharing`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        check_layer_config(config)  # before super(), whose context-parallel assert is misleading
        super().__init__(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        # Megatron divides the scale by the layer number under query-key layer scaling and
        # multiplies it back inside the softmax; the kernels take the net scale.
        self.net_softmax_scale = self.softmax_scale * (
            self.layer_number if config.apply_query_key_layer_scaling else 1
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            )
        if attention_bias is not None:
            raise UnsupportedSetupError("prefix sharing does not support an attention_bias")
        if self.training and self.attention_dropout.p > 0:
            raise UnsupportedSetupError(
                f"attention_dropout={self.attention_dropout.p} in training: the varlen kernels "
                "here run without dropout; set attention_dropout=0"
            )
        if isinstance(packed_seq_params, PlanPackedSeqParams):
            plan = packed_seq_params.plan
            check_sharing_allowed(self.config, plan, self.training)
            out = prefix_attention(
                query, key, value, plan, softmax_scale=self.net_softmax_scale,
                backend=packed_seq_params.backend,
            )
        else:
            out = self._plain_thd(query, key, value, packed_seq_params)
        return out.reshape(out.size(0), -1)  # [T, np, hn] -> [T, np * hn]

    def _plain_thd(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """Megatron's own THD layout (e.g. verl's): segments as laid out in the tensors.

        With ``*_padded`` boundaries each sequence's pad tokens follow its real ones, so causal
        attention over the padded segment leaves the real tokens' outputs unchanged.
        """
        cu_q = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
        cu_kv = params.cu_seqlens_kv if params.cu_seqlens_kv_padded is None else params.cu_seqlens_kv_padded
        return varlen_attention(
            query, key, value, cu_q, cu_kv,
            int((cu_q[1:] - cu_q[:-1]).max()), int((cu_kv[1:] - cu_kv[:-1]).max()),
            self.net_softmax_scale,
        )
