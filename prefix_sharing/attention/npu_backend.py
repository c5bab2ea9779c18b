"""The Ascend backend: ``torch_npu.npu_fusion_attention`` in TND layout, ``sparse_mode=3``."""

from __future__ import annotations

import torch

__all__ = ["varlen_attention_npu"]

# sparse_mode 3 takes this fixed "compressed" mask (True = masked) whatever the sequence lengths;
# built once per device.
_COMPRESSED_MASK_SIZE = 2048
_COMPRESSED_MASKS: dict[torch.device, torch.Tensor] = {}


def varlen_attention_npu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal varlen attention on Ascend's fused attention kernel (torch_npu, Atlas A2).

    ``input_layout="TND"`` is the varlen layout: segment lengths come as host int lists of
    cumulative ends *without* the leading 0 (lengths 2, 3 -> ``[2, 5]``), one list for queries
    and one for keys/values. ``sparse_mode=3`` ("rightDownCausal") aligns the causal mask to the
    bottom-right corner of every segment, with the compressed 2048x2048 upper-triangular mask.
    ``head_num`` is the number of query heads; k/v may have fewer (GQA, ``nheads % nheads_k ==
    0``).

    The kernel takes float16 or bfloat16 q/k/v (recent torch_npu also float32) and segments
    with ``s <= L`` (a longer query segment would have fully masked rows). Converting
    ``cu_seqlens`` to host lists synchronizes with the device once per call.

    Args:
        q: ``(total_q, nheads, headdim)``.
        k, v: ``(total_k, nheads_k, headdim)``, same dtype.
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries.
        max_seqlen_q, max_seqlen_k: unused (the kernel reads the lengths from the lists).
        softmax_scale: defaults to ``headdim ** -0.5``.

    Returns:
        ``(total_q, nheads, headdim)`` in q's dtype, differentiable.
    """
    del max_seqlen_q, max_seqlen_k
    import torch_npu

    scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
    return torch_npu.npu_fusion_attention(
        q,
        k,
        v,
        q.size(1),
        input_layout="TND",
        atten_mask=_compressed_causal_mask(q.device),
        scale=scale,
        keep_prob=1.0,
        actual_seq_qlen=cu_seqlens_q[1:].tolist(),
        actual_seq_kvlen=cu_seqlens_k[1:].tolist(),
        sparse_mode=3,
    )[0]


def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    mask = _COMPRESSED_MASKS.get(device)
    if mask is None:
        n = _COMPRESSED_MASK_SIZE
        mask = _COMPRESSED_MASKS[device] = torch.triu(torch.ones(n, n), 1).bool().to(device)
    return mask
