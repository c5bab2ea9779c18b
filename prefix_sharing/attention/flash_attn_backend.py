"""The flash-attn backend: ``flash_attn_varlen_func`` with ``causal=True`` (CUDA)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..refusals import refuse
from .backends import check_no_row_bounds
from .kernel_limits import check_flash_attn

__all__ = ["attention_lse_backward_flash", "attention_lse_flash", "varlen_attention_flash"]


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

    head_dim_v = _check_value_head_dim(q, v)
    # [t, h, dv] -> [t, h, d]: zeros add nothing to the output
    out = flash_attn_varlen_func(
        q, k, _pad(v, q.size(-1)), *_boundaries(q, cu_seqlens_q, cu_seqlens_k),
        max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=softmax_scale, causal=True,
        window_size=_window_size(window),
    )
    return out if head_dim_v == out.size(-1) else out[..., :head_dim_v]


# ------------------------------------------------------------------ with the log-sum-exp
# The forward is the public ``flash_attn_varlen_func(..., return_attn_probs=True)``, which
# also returns ``softmax_lse`` ``(nheads, total_q)`` float32 (natural log); the backward is
# flash-attn's ``_flash_attn_varlen_backward`` (flash-attn >= 2.6: ``window_size_left`` /
# ``window_size_right`` / ``softcap`` keywords), which takes the output and log-sum-exp to
# differentiate at - what ring attention calls with the merged ones. ``deterministic=True``:
# its dq is then accumulated without atomics, so a rerun gives the same bits.


def attention_lse_flash(
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
    """``(out, lse)`` on flash-attn, as :func:`~.torch_backend.attention_lse_torch` (no
    autograd; a segment may hold no query). ``first_key`` must be ``None``: flash-attn's band
    is one ``window_size`` per call (:data:`~.backends.ROW_KEY_BOUNDS`)."""
    del cu_seqlens_q_host, cu_seqlens_k_host
    check_no_row_bounds("flash_attn", first_key)
    check_flash_attn(q)
    from flash_attn import flash_attn_varlen_func

    head_dim_v = _check_value_head_dim(q, v)
    out, lse, _ = flash_attn_varlen_func(
        q, k, _pad(v, q.size(-1)), *_boundaries(q, cu_seqlens_q, cu_seqlens_k),
        max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
        window_size=_window_size(window), return_attn_probs=True)
    return out[..., :head_dim_v], lse


def attention_lse_backward_flash(
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
    """``(dq, dk, dv)`` of :func:`attention_lse_flash` at the given ``out`` and ``lse``."""
    del cu_seqlens_q_host, cu_seqlens_k_host
    check_no_row_bounds("flash_attn", first_key)
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    head_dim_v = _check_value_head_dim(q, v)
    v_full = _pad(v, q.size(-1))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_full)
    left, right = _window_size(window)
    _flash_attn_varlen_backward(
        _pad(dout, q.size(-1)).contiguous(), q, k, v_full, _pad(out, q.size(-1)).contiguous(),
        lse.float().contiguous(), dq, dk, dv, *_boundaries(q, cu_seqlens_q, cu_seqlens_k),
        max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale,
        causal=causal, window_size_left=left, window_size_right=right, softcap=0.0,
        alibi_slopes=None, deterministic=True)
    return dq, dk, dv[..., :head_dim_v]


def _check_value_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    if v.size(-1) > q.size(-1):
        raise refuse("kernels.value_head_dim", f"value head dim {v.size(-1)} is larger than "
                     f"the query/key head dim {q.size(-1)}")
    return v.size(-1)


def _pad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[t, h, dv] -> [t, h, head_dim]`` with zeros: flash-attn 2 takes one head dim."""
    return x if x.size(-1) == head_dim else torch.nn.functional.pad(x, (0, head_dim - x.size(-1)))


def _boundaries(q, cu_seqlens_q, cu_seqlens_k):
    return (cu_seqlens_q.to(device=q.device, dtype=torch.int32),
            cu_seqlens_k.to(device=q.device, dtype=torch.int32))


def _window_size(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, 0)
