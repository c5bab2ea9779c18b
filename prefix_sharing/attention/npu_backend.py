"""The Ascend backend: ``torch_npu.npu_fusion_attention`` in TND layout (``sparse_mode=3``), and
its with-lse pair for attention over key sources."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..refusals import refuse
from .backends import check_no_row_bounds, host_boundaries
from .kernel_limits import check_npu, segment_chunks

__all__ = ["attention_lse_backward_npu", "attention_lse_npu", "varlen_attention_npu"]

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

    check_npu(q, k)
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    outputs = [_fusion_attention(q, k, v, call, softmax_scale, True, window)[0]
               for call in _calls(bounds_q, bounds_k)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


# ------------------------------------------------------------------ with the log-sum-exp
# npu_fusion_attention also returns its softmax statistics, float32: ``softmax_max`` (the
# row's largest scaled score) and ``softmax_sum`` (``sum_j exp(scale * q . k_j - max)``), so
# ``lse = softmax_max + log(softmax_sum)``. In TND both are ``[T, N, 8]`` tensors whose 8
# lanes repeat one value, and whose rows are laid out segment by segment, heads first within
# a segment: segment b's ``s_b`` rows occupy ``s_b * N`` consecutive ``8``-lane rows as
# ``[N, s_b, 8]`` (op-plugin FlashAttentionKernelNpuOpApi.cpp allocates ``{T, N, 8}``; the
# layout is what MindSpeed's TND ring attention reads, ``flatten_softmax`` /
# ``unflatten_softmax`` in ``mindspeed/core/context_parallel/utils.py``, and what the
# ``softmax_layout`` keyword of torch_npu 7.2 calls the default, "NTD", as opposed to "TND").
# ``npu_fusion_attention_grad`` takes them back with the output (``attention_in``): given
# the *merged* log-sum-exp as ``softmax_max`` and ones as ``softmax_sum``, its weights
# ``exp(scale * q . k - max) / sum`` are each key's share of the whole softmax - ring
# attention's rule, as for flash-attn (:mod:`.merge`).


def attention_lse_npu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    first_key: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention on ``npu_fusion_attention`` (TND) returning ``(out, lse)``, without
    autograd (the caller's Function runs :func:`attention_lse_backward_npu`).

    Args:
        q: ``(total_q, nheads, headdim)``, float16, bfloat16 or float32.
        k, v: ``(total_k, nheads_k, headdim[_v])``, same dtype; ``nheads % nheads_k == 0``
            (the kernel documents ``Dk >= Dv``).
        cu_seqlens_q, cu_seqlens_k: ``(num_segments + 1,)`` segment boundaries; a segment
            may hold no query (its keys are read by nobody; the kernel takes a query length
            of 0).
        max_seqlen_q, max_seqlen_k: unused (the kernel reads the lengths from the lists).
        softmax_scale: defaults to ``headdim ** -0.5``.
        causal: ``sparse_mode=3`` (bottom-right causal, the compressed 2048x2048 mask), or
            ``sparse_mode=0`` without a mask: every query of a segment reads every key of it
            (the dense rectangle of a shared node's readers).
        window: keys each query sees, itself included (``sparse_mode=4``, as
            :func:`varlen_attention_npu`); causal calls only.
        first_key: must be ``None``: the kernel's band is one ``pre_tockens`` per call
            (:data:`~.backends.ROW_KEY_BOUNDS`).
        cu_seqlens_q_host, cu_seqlens_k_host: the same boundaries as host ints (read from the
            device when omitted).

    Returns:
        out: ``(total_q, nheads, headdim_v)`` in q's dtype.
        lse: ``(nheads, total_q)`` float32, natural log: ``softmax_max + log(softmax_sum)``,
            flash-attn's ``softmax_lse`` layout and meaning.
    """
    del max_seqlen_q, max_seqlen_k
    check_no_row_bounds("npu", first_key)
    check_npu(q, k)
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    out = q.new_empty(q.size(0), q.size(1), v.size(-1))
    lse = torch.empty(q.size(1), q.size(0), dtype=torch.float32, device=q.device)
    for call in _calls(bounds_q, bounds_k, causal):
        q0, q1, _, _, ends_q, _ = call
        if q1 == q0:  # only segments without queries: nothing to compute
            continue
        result = _fusion_attention(q, k, v, call, softmax_scale, causal, window)
        out[q0:q1] = result[0]
        softmax_max, softmax_sum = (x.reshape(-1, x.size(-1))[:, 0] for x in result[1:3])
        _, from_kernel = _softmax_rows(tuple(ends_q), q.size(1), q.device)
        rows = (softmax_max + softmax_sum.log())[from_kernel]  # (token, head) order
        lse[:, q0:q1] = rows.view(q1 - q0, q.size(1)).t()
    return out, lse


def attention_lse_backward_npu(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    *,
    causal: bool = True,
    window: int | None = None,
    first_key: torch.Tensor | None = None,
    cu_seqlens_q_host: Sequence[int] | None = None,
    cu_seqlens_k_host: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`attention_lse_npu` at the given ``out`` and ``lse``
    (``npu_fusion_attention_grad`` with ``softmax_max`` = ``lse`` in the kernel's layout,
    ``softmax_sum`` = 1 and ``attention_in`` = ``out``). Arguments as there, plus ``dout``
    ``(total_q, nheads, headdim)`` and ``out`` in q's dtype and ``lse`` ``(nheads, total_q)``
    float32. Keys of segments without queries get zero gradients."""
    del max_seqlen_q, max_seqlen_k
    check_no_row_bounds("npu", first_key)
    import torch_npu

    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    bounds_k = host_boundaries(cu_seqlens_k, cu_seqlens_k_host)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q1, k0, k1, ends_q, ends_k in _calls(bounds_q, bounds_k, causal):
        if q1 == q0:
            continue
        to_kernel, _ = _softmax_rows(tuple(ends_q), q.size(1), q.device)
        rows = lse[:, q0:q1].t().float().reshape(-1)[to_kernel]  # the kernel's row order
        softmax_max = rows.view(q1 - q0, q.size(1), 1).expand(-1, -1, _LANES).contiguous()
        grads = torch_npu.npu_fusion_attention_grad(
            q[q0:q1], k[k0:k1], v[k0:k1], dout[q0:q1].contiguous(), q.size(1), "TND",
            softmax_max=softmax_max, softmax_sum=torch.ones_like(softmax_max),
            attention_in=out[q0:q1].contiguous(), scale_value=_scale(q, softmax_scale),
            keep_prob=1.0, actual_seq_qlen=ends_q, actual_seq_kvlen=ends_k,
            **_mask_mode(causal, window, q.device))
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = grads[:3]
    return dq, dk, dv


# lanes of a softmax statistic row: one value repeated
_LANES = 8


@functools.lru_cache(maxsize=4)
def _softmax_rows(ends_q: tuple[int, ...], heads: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(to_kernel, from_kernel)`` for one call's query segments (cumulative ends): the
    softmax statistics' rows in the kernel's order (segment by segment, ``[N, s_b]`` within
    one) as indices into the ``(token, head)`` order ``token * heads + head``, and back.
    Kept for the calls of one micro-batch's layers (the same segments every layer, forward
    and backward: two entries, its own segments' and its nodes'; each ``2 * T * N`` int64).
    """
    ends = np.asarray(ends_q, dtype=np.int64)
    lengths = np.diff(ends, prepend=0)
    starts = ends - lengths
    per_row = lengths * heads
    start = np.repeat(starts, per_row)
    length = np.repeat(lengths, per_row)
    offset = np.arange(int(per_row.sum())) - start * heads  # within the segment's block
    to_kernel = (start + offset % length) * heads + offset // length
    from_kernel = np.empty_like(to_kernel)
    from_kernel[to_kernel] = np.arange(to_kernel.size)
    return (torch.from_numpy(to_kernel).to(device), torch.from_numpy(from_kernel).to(device))


def _fusion_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: tuple,
                      softmax_scale: float | None, causal: bool, window: int | None) -> tuple:
    """``npu_fusion_attention``'s outputs (TND) on the rows of one :func:`_calls` entry: the
    forward of :func:`varlen_attention_npu` and of :func:`attention_lse_npu`."""
    import torch_npu

    q0, q1, k0, k1, ends_q, ends_k = call
    return torch_npu.npu_fusion_attention(
        q[q0:q1], k[k0:k1], v[k0:k1], q.size(1), input_layout="TND",
        scale=_scale(q, softmax_scale), keep_prob=1.0, actual_seq_qlen=ends_q,
        actual_seq_kvlen=ends_k, **_mask_mode(causal, window, q.device))


def _calls(bounds_q: Sequence[int], bounds_k: Sequence[int], causal: bool = True):
    """``(q0, q1, k0, k1, ends_q, ends_k)`` per kernel call: a TND call takes at most
    NPU_MAX_SEGMENTS segments, so more are run in consecutive calls, each on its segments'
    rows (contiguous in q and in k/v), ends counted from its first row. A causal call leaves
    out the segments with keys but no queries at either end (their keys are read by nobody,
    and the causal modes take no leading empty query segment): a context-parallel slice's
    own pieces start and end with one (:mod:`.sources`)."""
    for first, stop in segment_chunks(len(bounds_q) - 1):
        if causal:
            while first < stop and _keys_only(bounds_q, bounds_k, first):
                first += 1
            while stop > first and _keys_only(bounds_q, bounds_k, stop - 1):
                stop -= 1
            if first == stop:
                continue
        q0, q1, k0, k1 = bounds_q[first], bounds_q[stop], bounds_k[first], bounds_k[stop]
        yield (q0, q1, k0, k1, [e - q0 for e in bounds_q[first + 1: stop + 1]],
               [e - k0 for e in bounds_k[first + 1: stop + 1]])


def _keys_only(bounds_q: Sequence[int], bounds_k: Sequence[int], i: int) -> bool:
    return bounds_q[i + 1] == bounds_q[i] and bounds_k[i + 1] > bounds_k[i]


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale


def _mask_mode(causal: bool, window: int | None, device: torch.device) -> dict[str, Any]:
    """rightDownCausal, the band of the last ``window`` keys (also aligned bottom-right), both
    with the compressed mask; or no mask at all (every key of a segment)."""
    if not causal:
        if window is not None:
            raise ValueError("a sliding window applies to causal calls only")
        return dict(sparse_mode=0, atten_mask=None)
    if window is None:
        return dict(sparse_mode=3, atten_mask=_compressed_causal_mask(device))
    return dict(sparse_mode=4, pre_tockens=window - 1, next_tockens=0,
                atten_mask=_compressed_causal_mask(device))


def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    mask = _COMPRESSED_MASKS.get(device)
    if mask is None:
        n = _COMPRESSED_MASK_SIZE
        mask = _COMPRESSED_MASKS[device] = torch.triu(torch.ones(n, n), 1).bool().to(device)
    return mask
