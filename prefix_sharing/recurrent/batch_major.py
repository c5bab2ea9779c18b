"""The torch Gated DeltaNet kernels behind the batch-major calls of the frameworks' stock modules.

megatron-core's ``GatedDeltaNet`` and transformers' Qwen3.5 / Qwen3-Next layers call fla-style
kernels on batch-major tensors: ``[B, T, heads, dim]``, each row one sequence, or one packed row
(``B = 1``) cut by ``cu_seqlens``. On a CPU fla's Triton kernels cannot run, and the frameworks'
own torch fallbacks either refuse packed input (megatron's) or compute in float32 whatever the
inputs (both). The two functions here take those calls as they are and run them on this
package's torch kernels (:mod:`.torch_kernels`, checked against a token-by-token recurrence), so
that a *stock* module - the plain baseline ``bench`` times, the float64 references ``verify``
judges against - runs on a CPU with only its kernel call redirected:

- :func:`gated_delta_rule_batch_major`: ``chunk_gated_delta_rule(q, k, v, g, beta, ...)``;
- :func:`causal_conv1d_batch_major`: fla's ``causal_conv1d(x, weight, bias, ...)``.

The ``B`` rows (or the ``cu_seqlens`` segments) become the varlen segments of one kernel call.
Boundaries given as a tensor are read on the host with ``tolist()``: these functions serve
CPU-only processes, where that is a memory read, not a device sync (megatron's stock module
itself reads ``cu_seqlens[-1].item()`` in every layer).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError
from .torch_kernels import causal_conv1d_torch, chunk_gated_delta_rule_torch, \
    gated_delta_rule_recurrent

__all__ = ["gated_delta_rule_batch_major", "causal_conv1d_batch_major"]


def _segments(batch: int, length: int, cu_seqlens: Any) -> tuple[int, ...]:
    """Varlen boundaries of ``[batch, length]`` rows: each row a sequence, or with
    ``cu_seqlens`` (a packed row, ``batch == 1``) its segments."""
    if cu_seqlens is None:
        return tuple(range(0, (batch + 1) * length, length)) if length else (0,) * (batch + 1)
    if batch != 1:
        raise InputError(f"packed input (cu_seqlens) is one row; got a batch of {batch}")
    bounds = tuple(int(b) for b in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens)
                                    else cu_seqlens))
    if bounds[0] != 0 or bounds[-1] != length:
        raise InputError(f"cu_seqlens must run from 0 to the row's {length} tokens; got "
                         f"{bounds[0]}..{bounds[-1]}")
    return bounds


def gated_delta_rule_batch_major(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Any = None,
    token_by_token: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` call (as megatron and transformers make it) on the torch
    kernels.

    Args:
        query, key: ``[B, T, H, K]``; value ``[B, T, HV, V]``; g, beta ``[B, T, HV]``.
        scale: multiplies q; ``K ** -0.5`` when ``None``.
        initial_state: ``[N, HV, K, V]``, one per sequence (``N = B``, or the segments).
        output_final_state: also return each sequence's final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        cu_seqlens: ``[N + 1]`` boundaries of a packed row (``B == 1``), or ``None``.
        token_by_token: run the token-by-token recurrence (the readable reference, for float64
            references) instead of the chunked rule.
        _: other keywords of the callers' signatures (``chunk_size``, ``head_first``, ...),
            which do not change the result.

    Returns:
        ``(out [B, T, HV, V] in value's dtype, final [N, HV, K, V] or None)``, computed in
        float32, or float64 for float64 queries.
    """
    batch, length = query.shape[:2]
    bounds = _segments(batch, length, cu_seqlens)
    flat = [x.flatten(0, 1) for x in (query, key, value, g, beta)]  # [B * T, ...]
    kwargs = dict(scale=scale, initial_state=initial_state, cu_seqlens_host=bounds,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if token_by_token:
        out, final = gated_delta_rule_recurrent(*flat, **kwargs)
    else:
        out, final = chunk_gated_delta_rule_torch(*flat, output_final_state=output_final_state,
                                                  **kwargs)
    return out.view(batch, length, *out.shape[1:]), final if output_final_state else None


def causal_conv1d_batch_major(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """fla's ``causal_conv1d(x, weight, bias, activation=, cu_seqlens=)`` call (megatron's) on
    the torch gather convolution: each sequence starts from zeros.

    Args:
        x: ``[B, T, D]``; weight ``[D, W]``; bias ``[D]`` or ``None``.
        activation: ``None``, ``"silu"`` or ``"swish"``.
        cu_seqlens: ``[N + 1]`` boundaries of a packed row (``B == 1``), or ``None``.

    Returns:
        ``(out [B, T, D], None)``.

    Raises:
        InputError: an initial state or a final state asked for (no stock caller does).
    """
    if initial_state is not None or output_final_state:
        raise InputError("the torch stand-in for fla's causal_conv1d starts every sequence from "
                         "zeros and returns no final state")
    batch, length = x.shape[:2]
    bounds = torch.tensor(_segments(batch, length, cu_seqlens), dtype=torch.long)
    rows = torch.arange(batch * length)
    starts = bounds[torch.searchsorted(bounds[1:], rows, right=True)]  # each row's first row
    back = rows[:, None] - torch.arange(weight.size(1) - 1, 0, -1)[None, :]  # [B*T, W-1]
    predecessors = torch.where(back >= starts[:, None], back, -1).to(x.device)
    out = causal_conv1d_torch(x.flatten(0, 1), weight, bias, predecessors, activation)
    return out.view_as(x), None
