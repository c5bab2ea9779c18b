"""The flash-attn backend: ``flash_attn_varlen_func`` with ``causal=True`` (CUDA)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..refusals import refuse
from .kernel_limits import check_flash_attn

__all__ = ["varlen_attention_flash"]


def varlen_attention_flash(
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
    """Causal varlen attention on flash-attn's kernel (flash-attn >= 2.1, CUDA tensors).

    Since flash-attn 2.1, ``causal=True`` aligns the mask bottom-right in every (query, key)
    segment pair: the queries are the last ``s`` of the segment's ``L`` keys, exactly our
    layout. GQA is native (query head ``h`` reads key head ``h // (nheads // nheads_k)``).

    The kernel requires float16 or bfloat16 q/k/v and head dims up to 256 (refused before the
    call: :mod:`.kernel_limits`) and int32 ``cu_seqlens`` on q's device (converted here if
    needed); ``max_seqlen_*`` must be at least the longest segment.

    flash-attn 2 takes one head dim for q, k and v. A value head dim smaller than the query's
    (multi-latent attention: 192 / 128) is zero-padded to it for the call and the output
    trimmed back, as megatron-core does for MLA under THD: the padded channels of every output
    row are sums of zeros, and their gradient is dropped by the trim.

    Args:
        q: ``(total_q, nheads, headdim)``, float16 or bfloat16.
        k: ``(total_k, nheads_k, headdim)``, same dtype; ``nheads % nheads_k == 0``.
        v: ``(total_k, nheads_k, headdim_v)``, ``headdim_v <= headdim``.
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries.
        max_seqlen_q, max_seqlen_k: longest query / key segment.
        softmax_scale: defaults to ``headdim ** -0.5``.
        window: keys each query sees, itself included: ``window_size=(window - 1, 0)``, the
            band flash-attn aligns bottom-right like its causal mask (``None``: ``(-1, -1)``).
        sinks: refused: flash-attn 2 has no sink term in its softmax.
        cu_seqlens_q_host, cu_seqlens_k_host, kernel_cache: unused (the kernel reads the
            boundaries on the device and keeps no state).

    Returns:
        ``(total_q, nheads, headdim_v)`` in q's dtype, differentiable.
    """
    del cu_seqlens_q_host, cu_seqlens_k_host, kernel_cache
    if sinks is not None:
        raise refuse("kernels.sinks", "flash-attn 2")
    check_flash_attn(q)
    from flash_attn import flash_attn_varlen_func

    head_dim_v = v.size(-1)
    if head_dim_v > q.size(-1):
        raise refuse("kernels.value_head_dim", f"value head dim {head_dim_v} is larger than the "
                     f"query/key head dim {q.size(-1)}")


    if head_dim_v != q.size(-1):  # [t, h, dv] -> [t, h, d]: zeros add nothing to the output
        v = torch.nn.functional.pad(v, (0, q.size(-1) - head_dim_v))
    out = flash_attn_varlen_func(
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
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )
    return out if head_dim_v == out.size(-1) else out[..., :head_dim_v]
