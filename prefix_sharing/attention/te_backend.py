"""The Transformer Engine backend: ``DotProductAttention`` in THD format with a bottom-right
causal padding mask (CUDA), and a with-lse pair on TE's fused-attention functions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..refusals import refuse
from .backends import check_no_row_bounds, host_boundaries
from .kernel_limits import check_te

__all__ = ["attention_lse_backward_te", "attention_lse_te", "varlen_attention_te"]

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


# ------------------------------------------------------------------ with the log-sum-exp
# DotProductAttention returns no log-sum-exp. Transformer Engine's fused-attention functions do
# (``transformer_engine.pytorch.cpp_extensions.fused_attn``: ``fused_attn_fwd`` /
# ``fused_attn_bwd``, what TE's own context-parallel ring attention calls): on the cuDNN backend
# (``F16_arbitrary_seqlen``) the forward's ``aux_ctx_tensors`` are ``[softmax_stats,
# rng_state]``, the stats each query row's natural-log softmax denominator in float32 - THD rows
# ``[t, h, 1]`` from cuDNN 9.6, ``[b, h, max_seqlen_q, 1]`` per segment before (TE's
# ``softmax_lse_in_packed_format``) - and the backward takes them back with the output to
# differentiate at: ring attention hands it the merged ones, as the merge over sources does.
# Keywords only, as every release from 2.2 names them (their order moved); ``dqkv_dtype``
# where the release takes it (2.2 to 2.12). No dropout, so the backward's rng_state is unread.


def attention_lse_te(
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
    """``(out, lse)`` on Transformer Engine's fused attention (cuDNN), as
    :func:`~.torch_backend.attention_lse_torch` (no autograd; a non-causal call's segment may
    hold no query): ``attn_mask_type`` ``"padding_causal_bottom_right"`` (``window``:
    ``window_size=(window - 1, 0)``) or ``"padding"`` (every key of a segment), THD for q, k
    and v (``"thd_thd_thd"``; a smaller value head dim is taken as it is). ``first_key`` must
    be ``None`` (:data:`~.backends.ROW_KEY_BOUNDS`)."""
    check_no_row_bounds("te", first_key)
    fused = _fused_attention(q)
    bounds_q = host_boundaries(cu_seqlens_q, cu_seqlens_q_host)
    out, aux = fused.fused_attn_fwd(
        is_training=True, q=q, k=k, v=v, fake_dtype=q.dtype,
        **_fused_arguments(fused, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window))
    return out, _lse_of_stats(aux[0], tuple(bounds_q), _packed_stats())


def attention_lse_backward_te(
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
    """``(dq, dk, dv)`` of :func:`attention_lse_te` at the given ``out`` and ``lse``
    (``fused_attn_bwd`` with the stats written back in the kernel's layout, deterministic)."""
    check_no_row_bounds("te", first_key)
    fused = _fused_attention(q)
    bounds_q = tuple(host_boundaries(cu_seqlens_q, cu_seqlens_q_host))
    stats = _stats_of_lse(lse, bounds_q, max_seqlen_q, _packed_stats())
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: unread
    extra = {}
    if _takes_dqkv_dtype(fused.fused_attn_bwd):
        from transformer_engine.pytorch.constants import TE_DType

        extra["dqkv_dtype"] = TE_DType[q.dtype]
    dq, dk, dv, *_ = fused.fused_attn_bwd(
        q=q, k=k, v=v, o=out.contiguous(), d_o=dout.contiguous(), fake_dtype=q.dtype,
        aux_ctx_tensors=[stats, rng_state], deterministic=True, **extra,
        **_fused_arguments(fused, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window))
    return dq, dk, dv


@functools.cache
def _takes_dqkv_dtype(fused_attn_bwd: Any) -> bool:
    """Whether this release's ``fused_attn_bwd`` takes ``dqkv_dtype`` (2.2 to 2.12): read once,
    not in every layer's backward."""
    return "dqkv_dtype" in inspect.signature(fused_attn_bwd).parameters


def _fused_attention(q: torch.Tensor) -> Any:
    import transformer_engine
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    check_te(q, transformer_engine.__version__)
    return fused_attn


def _fused_arguments(fused: Any, q: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float | None, causal: bool,
                     window: int | None) -> dict[str, Any]:
    """The keywords ``fused_attn_fwd`` and ``fused_attn_bwd`` share: THD segments (padded
    boundaries = the real ones: no padding between segments), the mask and the scale."""
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    return dict(
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_k, cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_k, cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k,
        fused_attention_backend=fused.FusedAttnBackend["F16_arbitrary_seqlen"],
        attn_scale=q.size(-1) ** -0.5 if softmax_scale is None else float(softmax_scale),
        dropout=0.0, qkv_layout="thd_thd_thd",
        attn_mask_type="padding_causal_bottom_right" if causal else "padding",
        window_size=(-1, -1) if window is None else (window - 1, 0))


def _packed_stats() -> bool:
    """Whether cuDNN returns THD softmax statistics per row (``[t, h, 1]``, cuDNN >= 9.6)."""
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version()) >= (9, 6, 0)


def _lse_of_stats(stats: torch.Tensor, bounds_q: tuple[int, ...], packed: bool) -> torch.Tensor:
    """The kernel's softmax statistics as ``(nheads, total_q)`` float32."""
    if packed:
        return stats[..., 0].t().float()
    segment, position = _row_places(bounds_q, stats.device)
    return stats[segment, :, position, 0].t().float()


def _stats_of_lse(lse: torch.Tensor, bounds_q: tuple[int, ...], max_seqlen_q: int,
                  packed: bool) -> torch.Tensor:
    """``lse`` ``(nheads, total_q)`` in the kernel's statistics layout (zeros past each
    segment's rows, which the kernel does not read)."""
    rows = lse.t().float().contiguous()
    if packed:
        return rows[..., None]
    segment, position = _row_places(bounds_q, lse.device)
    stats = rows.new_zeros(len(bounds_q) - 1, lse.size(0), max_seqlen_q, 1)
    stats[segment, :, position, 0] = rows
    return stats


@functools.lru_cache(maxsize=4)
def _row_places(bounds_q: tuple[int, ...],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query row, its segment and its place in the segment (the padded layout's
    indices). Kept for the calls of one micro-batch's layers."""
    lengths = np.diff(bounds_q)
    segment = np.repeat(np.arange(lengths.size), lengths)
    position = np.arange(bounds_q[-1]) - np.repeat(np.asarray(bounds_q[:-1]), lengths)
    return torch.from_numpy(segment).to(device), torch.from_numpy(position).to(device)
