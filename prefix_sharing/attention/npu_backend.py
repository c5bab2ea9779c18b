"""The Ascend backend: ``torch_npu.npu_fusion_attention`` in TND layout, ``sparse_mode=3``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..refusals import refuse
from .kernel_limits import check_npu, segment_chunks

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
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
    kernel_cache: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Causal varlen attention on Ascend's fused attention kernel (torch_npu, Atlas A2).

    ``input_layout="TND"`` is the varlen layout: segment lengths come as host int lists of
    cumulative ends *without* the leading 0 (lengths 2, 3 -> ``[2, 5]``), one list for queries
    and one for keys/values. ``sparse_mode=3`` ("rightDownCausal") aligns the causal mask to the
    bottom-right corner of every segment, with the compressed 2048x2048 upper-triangular mask.
    ``head_num`` is the number of query heads; k/v may have fewer (GQA, ``nheads % nheads_k ==
    0``).

    The kernel takes float16 or bfloat16 q/k/v (recent torch_npu also float32) and segments
    with ``s <= L`` (a longer query segment would have fully masked rows). Its documented
    limits (:mod:`.kernel_limits`): at most 1024 segments per call - more are computed in
    consecutive calls of at most 1024 segments each, which gives the same result, since
    segments never attend to each other - head dim up to 768 and up to 256 query heads (both
    refused before the call). The lists come from
    ``cu_seqlens_*_host`` when given; otherwise ``cu_seqlens`` is read back from the device, a
    synchronization in every call.

    Args:
        q: ``(total_q, nheads, headdim)``.
        k, v: ``(total_k, nheads_k, headdim)``, same dtype.
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries.
        max_seqlen_q, max_seqlen_k: unused (the kernel reads the lengths from the lists).
        softmax_scale: defaults to ``headdim ** -0.5``.
        window: keys each query sees, itself included: ``sparse_mode=4`` (band) with
            ``pre_tockens=window - 1`` and ``next_tockens=0``, the band aligned bottom-right per
            segment in TND, with the same compressed mask (``None``: ``sparse_mode=3``).
        sinks: refused: ``npu_fusion_attention`` has no sink term.
        cu_seqlens_q_host, cu_seqlens_k_host: the same boundaries as host ints.
        kernel_cache: unused (the mask is shared by every layer on a device).

    Returns:
        ``(total_q, nheads, headdim)`` in q's dtype, differentiable.
    """
    del max_seqlen_q, max_seqlen_k, kernel_cache
    if sinks is not None:
        raise refuse("kernels.sinks", "npu_fusion_attention")

    import torch_npu

    check_npu(q, k)
    bounds_q = cu_seqlens_q.tolist() if cu_seqlens_q_host is None else list(cu_seqlens_q_host)
    bounds_k = cu_seqlens_k.tolist() if cu_seqlens_k_host is None else list(cu_seqlens_k_host)

    scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
    outputs = []
    # a TND call takes at most NPU_MAX_SEGMENTS segments: more are run in consecutive calls,
    # each on its segments' rows (contiguous in q and in k/v), ends counted from its first row
    for first, stop in segment_chunks(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[first], bounds_q[stop], bounds_k[first], bounds_k[stop]
        outputs.append(torch_npu.npu_fusion_attention(
            q[q0:q1],
            k[k0:k1],
            v[k0:k1],
            q.size(1),
            input_layout="TND",
            atten_mask=_compressed_causal_mask(q.device),
            scale=scale,
            keep_prob=1.0,
            actual_seq_qlen=[e - q0 for e in bounds_q[first + 1: stop + 1]],
            actual_seq_kvlen=[e - k0 for e in bounds_k[first + 1: stop + 1]],
            **_mask_mode(window),
        )[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _mask_mode(window: int | None) -> dict[str, int]:
    """rightDownCausal, or the band of the last ``window`` keys (also aligned bottom-right)."""
    if window is None:
        return dict(sparse_mode=3)
    return dict(sparse_mode=4, pre_tockens=window - 1, next_tockens=0)


def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    mask = _COMPRESSED_MASKS.get(device)
    if mask is None:
        n = _COMPRESSED_MASK_SIZE
        mask = _COMPRESSED_MASKS[device] = torch.triu(torch.ones(n, n), 1).bool().to(device)
    return mask
