"""The Transformer Engine backend: ``DotProductAttention`` in THD format with a bottom-right
causal padding mask (CUDA)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..refusals import refuse
from .kernel_limits import check_te

__all__ = ["varlen_attention_te"]

# TE's DotProductAttention holds no weights here (vanilla softmax, no dropout) but keeps state
# across calls (its chosen kernel, FP8 metadata), so it is built once per layer, like
# megatron's own TE attention, and kept in the caller's ``kernel_cache`` (one dict per layer).
# Direct calls without one share this process-wide cache. The key is the constructor
# configuration; the activation dtype is not one: TE reads it from the inputs at every forward.
# key: ("te", num_attention_heads, num_gqa_groups, k head dim, v head dim, softmax_scale)
_MODULES: dict[Any, torch.nn.Module] = {}


def varlen_attention_te(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
    kernel_cache: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Causal varlen attention on Transformer Engine (>= 2.2 with cuDNN >= 9.7, CUDA tensors).

    ``qkv_format="thd"`` with ``attn_mask_type="padding_causal_bottom_right"``: each segment
    has its own query and key/value lengths (``cu_seqlens_q`` != ``cu_seqlens_kv``, same shape),
    and the causal mask is aligned to the bottom-right corner, so the queries are the last
    ``s`` of the segment's ``L`` keys. GQA through ``num_gqa_groups = nheads_k``.

    TE's THD kernels (cuDNN, flash-attn) need float16 or bfloat16 q/k/v and head dims up to
    256, and its cuDNN kernel takes this mask for segments of any length only from TE 2.2:
    anything else is refused before the call (:mod:`.kernel_limits`, which cites TE's source).
    ``cu_seqlens`` must be int32 on q's device (converted here if needed). Context
    parallelism disables bottom-right masks in TE.

    Different key and value head dims (multi-latent attention: 192 / 128) go to TE as
    ``kv_channels=(headdim, headdim_v)``, which its THD kernels take directly.

    Args:
        q: ``(total_q, nheads, headdim)``.
        k: ``(total_k, nheads_k, headdim)``, same dtype; ``nheads % nheads_k == 0``.
        v: ``(total_k, nheads_k, headdim_v)``.
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries.
        max_seqlen_q, max_seqlen_k: longest query / key segment.
        softmax_scale: defaults to ``headdim ** -0.5``.
        window: keys each query sees, itself included: the forward's ``window_size=(window -
            1, 0)``, which TE aligns bottom-right with this mask type (``None``: no window).
        sinks: refused: TE (>= 2.8) keeps its own ``softmax_offset`` parameter inside its
            module, not the caller's; this package has not wired or validated that.
        cu_seqlens_q_host, cu_seqlens_k_host: unused (TE reads the boundaries on the device).
        kernel_cache: the calling layer's dict, where its ``DotProductAttention`` is kept;
            a process-wide cache when omitted.

    Returns:
        ``(total_q, nheads, headdim_v)`` in q's dtype, differentiable.
    """
    del cu_seqlens_q_host, cu_seqlens_k_host
    if sinks is not None:
        raise refuse("kernels.sinks", "Transformer Engine")

    import transformer_engine
    from transformer_engine.pytorch import DotProductAttention

    check_te(q, transformer_engine.__version__)

    total_q, nheads, headdim = q.shape
    nheads_k, headdim_v = k.size(1), v.size(-1)
    scale = headdim**-0.5 if softmax_scale is None else float(softmax_scale)
    cache = _MODULES if kernel_cache is None else kernel_cache
    key = ("te", nheads, nheads_k, headdim, headdim_v, scale)
    attention = cache.get(key)
    if attention is None:
        attention = cache[key] = DotProductAttention(
            nheads,
            headdim if headdim_v == headdim else (headdim, headdim_v),
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
        window_size=None if window is None else (window - 1, 0),
    )
    return out.view(total_q, nheads, headdim_v)  # [t, h*dv] -> [t, h, dv]
