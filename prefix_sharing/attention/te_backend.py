"""The Transformer Engine backend: ``DotProductAttention`` in THD format with a bottom-right
causal padding mask (CUDA)."""

from __future__ import annotations

import torch

__all__ = ["varlen_attention_te"]

# One DotProductAttention per constructor configuration, built on first use. The module holds
# no weights (vanilla softmax, no dropout) but keeps state across calls (its chosen kernel,
# FP8 metadata), so it is built once like a layer's, not per call. The activation dtype is not a
# constructor argument: TE reads it from the inputs at every forward.
# key: (num_attention_heads, num_gqa_groups, kv_channels, softmax_scale)
_MODULES: dict[tuple[int, int, int, float], torch.nn.Module] = {}


def varlen_attention_te(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal varlen attention on Transformer Engine (>= 2.0, CUDA tensors).

    ``qkv_format="thd"`` with ``attn_mask_type="padding_causal_bottom_right"``: each segment
    has its own query and key/value lengths (``cu_seqlens_q`` != ``cu_seqlens_kv``, same shape),
    and the causal mask is aligned to the bottom-right corner, so the queries are the last
    ``s`` of the segment's ``L`` keys. GQA through ``num_gqa_groups = nheads_k``.

    TE's fused kernels (cuDNN, flash-attn) need float16 or bfloat16 q/k/v; other dtypes fall to
    its unfused path where TE allows it. ``cu_seqlens`` must be int32 on q's device (converted
    here if needed). Context parallelism disables bottom-right masks in TE.

    Args:
        q: ``(total_q, nheads, headdim)``.
        k, v: ``(total_k, nheads_k, headdim)``, same dtype; ``nheads % nheads_k == 0``.
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries.
        max_seqlen_q, max_seqlen_k: longest query / key segment.
        softmax_scale: defaults to ``headdim ** -0.5``.

    Returns:
        ``(total_q, nheads, headdim)`` in q's dtype, differentiable.
    """
    from transformer_engine.pytorch import DotProductAttention

    total_q, nheads, headdim = q.shape
    nheads_k = k.size(1)
    scale = headdim**-0.5 if softmax_scale is None else float(softmax_scale)
    key = (nheads, nheads_k, headdim, scale)
    attention = _MODULES.get(key)
    if attention is None:
        attention = _MODULES[key] = DotProductAttention(
            nheads,
            headdim,
            num_gqa_groups=nheads_k,
            qkv_format="thd",
            attn_mask_type="padding_causal_bottom_right",
            softmax_scale=scale,
        )
    out = attention(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q.to(device=q.device, dtype=torch.int32),
        cu_seqlens_kv=cu_seqlens_k.to(device=q.device, dtype=torch.int32),
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_k,
    )
    return out.view(total_q, nheads, headdim)  # [t, h*d] -> [t, h, d]
