"""Megatron multi-latent attention (DeepSeek-V3, Kimi K2, GLM) with prefix sharing.

``MLASelfAttention`` projects each token to a compressed latent (``kv_lora_rank``) plus one
rotary key shared by all heads (``qk_pos_emb_head_dim``), then up-projects the latent to
per-head keys (``qk_head_dim`` no-position channels, the rotary key appended) and values
(``v_head_dim``). Two things change under sharing:

- **Rotary positions.** Megatron rotates the rotary slice itself, inside its projection: under
  THD with ``cu_seqlens`` (positions restart at 0 per segment, a loop per sequence with a
  device-to-host read) or with TE's fused MLA RoPE. A reuser's tail starts at its prefix
  length, so for a planned micro-batch this layer runs megatron's projection on the
  ``[T, 1, ...]`` BSHD path instead and hands it a rotary table of one row per flat token
  (``plan.position_ids``): megatron's own ``apply_rotary_pos_emb`` then rotates every token at
  its absolute position in one elementwise pass - the interleaved or rotate-half layout, the
  MLA de-interleave, YaRN's ``mscale``, all as megatron computes them.
  Under context parallelism each rank's rows are its contiguous slice of the flat layout and
  the table its slice of those rows (the plan's absolute positions); megatron's own table is
  requested unsplit (its BSHD call would cut it into zigzag chunks of ``0..T_flat-1``).
- **Context parallelism**: the per-head K and V (192 / 128 channels on DeepSeek-V3) are
  all-gathered over the CP group in the core attention, as for GQA
  (:mod:`.context_parallel`); dK / dV are reduce-scattered back.
- **K/V injection** happens on the per-head keys and values after the up-projection, in the
  shared :class:`~.core_attention.PrefixSharingCoreAttention` (which takes the different key
  and value head dims, 192 / 128 on DeepSeek-V3). Gathering the compressed latent plus the
  rotary key instead would move fewer bytes per gathered row (576 vs 16 x 320 channels per
  token on DeepSeek-V3), but every reader would then have to up-project its provider's
  prefix rows again - the very matrix products sharing exists to skip - and the kernels
  read per-head K/V anyway. The gather is a copy, the up-projection a GEMM per layer per
  reader: the per-head form is the cheaper one, and it keeps one core attention for GQA and
  MLA.

Without a plan (megatron's own THD or padded inputs) everything is the stock
``MLASelfAttention``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from .core_attention import require_sharing_core_attention
from .packed_seq import PlanPackedSeqParams
from .self_attention import planned_call

__all__ = ["PrefixSharingMLASelfAttention"]

_FORWARD_SIGNATURE = inspect.signature(MLASelfAttention.forward)


class PrefixSharingMLASelfAttention(MLASelfAttention):
    """``MLASelfAttention`` that rotates every flat token at its true position and injects the
    shared prefixes' per-head K/V (see the module docstring for why there).

    Shapes for a planned micro-batch (this rank's heads; ``T`` = flat tokens):
    query / key ``[T, np, qk_head_dim + qk_pos_emb_head_dim]``, value ``[T, np, v_head_dim]``
    -> core attention output ``[T, np * v_head_dim]``.
    """

    # the micro-batch's params while a planned forward runs (read by the rotary hook)
    _planned: PlanPackedSeqParams | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_sharing_core_attention(self)
        self.rotary_pos_emb.register_forward_pre_hook(self._whole_rotary_table, with_kwargs=True)
        self.rotary_pos_emb.register_forward_hook(self._per_token_rotary)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        planned = planned_call(_FORWARD_SIGNATURE, self, args, kwargs)
        if planned is None:
            return super().forward(*args, **kwargs)
        self._planned = planned[1]
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._planned = None

    def get_query_key_value_tensors(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
    ) -> tuple[torch.Tensor, ...]:
        """Megatron's query, key, value (and the compressed q / kv it returns with them).

        For a planned micro-batch megatron computes them as for a ``[T, 1]`` BSHD batch (no
        ``cu_seqlens``: the rotary table is the per-token one the hook substitutes), and the
        batch dimension is dropped as its THD path drops it: ``[T, 1, np, d] -> [T, np, d]``.
        """
        if self._planned is None or packed_seq_params is not self._planned:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params,
                inference_context, inference_params=inference_params,
            )
        query, key, value, q_compressed, kv_compressed = super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, None, inference_context,
            inference_params=inference_params,
        )
        return query.squeeze(1), key.squeeze(1), value.squeeze(1), q_compressed, kv_compressed

    def _run_core_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, packed_seq_params: Any = None,
                            attn_mask_type: Any = None, **extra_kwargs: Any) -> torch.Tensor:
        """megatron-core 0.19+ zero-pads V to the query's head dim under THD (for flash-attn 2)
        before the core attention; a planned micro-batch's V reaches the sharing core
        attention unpadded, so the gather copies only its own channels and each kernel pads
        where it must (:mod:`prefix_sharing.attention.flash_attn_backend`)."""
        if isinstance(packed_seq_params, PlanPackedSeqParams):
            return self.core_attention(
                query, key, value, attention_mask, packed_seq_params=packed_seq_params,
                attn_mask_type=attn_mask_type or self.attn_mask_type, **extra_kwargs,
            )
        return super()._run_core_attention(  # type: ignore[misc]
            query, key, value, attention_mask, packed_seq_params=packed_seq_params,
            attn_mask_type=attn_mask_type, **extra_kwargs,
        )

    def _whole_rotary_table(self, module: torch.nn.Module, args: Any,
                            kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        """Forward pre-hook on megatron's rotary embedding: during a planned forward, the
        table is asked for as for a packed batch (``packed_seq=True``), which megatron never
        splits over context-parallel ranks. Its BSHD call would otherwise return this CP
        rank's zigzag chunks of positions ``0..T_flat-1``, not the absolute positions that
        :meth:`_per_token_rotary` reads its rows at."""
        del module
        if self._planned is None:
            return None
        return args, {**kwargs, "packed_seq": True}

    def _per_token_rotary(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """Forward hook on megatron's rotary embedding: during a planned forward, its table of
        positions ``0..S-1`` (``[S, 1, 1, d]``; YaRN returns ``(table, mscale)``) becomes one
        row per flat token at the token's absolute position, gathered once per micro-batch."""
        del module, args
        if self._planned is None:
            return output
        if isinstance(output, tuple):
            table, *rest = output
            return (self._planned.per_token_rotary(table), *rest)
        return self._planned.per_token_rotary(output)
