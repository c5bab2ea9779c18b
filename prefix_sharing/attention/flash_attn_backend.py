"""The flash-attn backend: ``flash_attn_varlen_func`` with ``causal=True`` (CUDA)."""

from __future__ import annotations

import torch

__all__ = ["varlen_attention_flash"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def varlen_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal varlen attention on flash-attn's kernel (flash-attn >= 2.1, CUDA tensors).

    Since flash-attn 2.1, ``causal=True`` aligns the mask bottom-right in every (query, key)
    segment pair: the queries are the last ``s`` of the segment's ``L`` keys, exactly our
    layout. GQA is native (query head ``h`` reads key head ``h // (nheads // nheads_k)``).

    The kernel requires float16 or bfloat16 q/k/v and int32 ``cu_seqlens`` on q's device
    (converted here if needed); ``max_seqlen_*`` must be at least the longest segment.

    Args:
        q: ``(total_q, nheads, headdim)``, float16 or bfloat16.
        k, v: ``(total_k, nheads_k, headdim)``, same dtype; ``nheads % nheads_k == 0``.
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries.
        max_seqlen_q, max_seqlen_k: longest query / key segment.
        softmax_scale: defaults to ``headdim ** -0.5``.

    Returns:
        ``(total_q, nheads, headdim)`` in q's dtype, differentiable.

    Raises:
        ValueError: q is not float16/bfloat16 (flash-attn has no float32 kernel).
    """
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(
            f"flash-attn computes in float16 or bfloat16 only, but q is {q.dtype}: run the model "
            "in half precision, or choose backend='torch'"
        )
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q.to(device=q.device, dtype=torch.int32),
        cu_seqlens_k.to(device=q.device, dtype=torch.int32),
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        causal=True,
    )
