"""flash-linear-attention's Triton kernels (``fla-core``, CUDA): argument construction and calls.

fla's varlen calls take a batch of one row (``[1, total, ...]``), ``cu_seqlens`` as an int64
device tensor and, to spare a device-to-host copy, ``cu_seqlens_cpu``. Both kernels take one
initial state per varlen sequence and their backward returns its gradient, which is how a
reuser's gradient reaches its provider's rows. The argument construction is a function of its
own (:func:`gated_delta_arguments`, :func:`conv_arguments`) so that it is tested on CPU against
the torch kernels' semantics; ``fla`` is imported only when a kernel is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["gated_delta_arguments", "chunk_gated_delta_rule_fla", "conv_arguments",
           "causal_conv1d_fla"]


def _boundaries(cu_seqlens: torch.Tensor, cu_seqlens_host: Sequence[int] | None,
                device: torch.device) -> dict[str, torch.Tensor]:
    host = (torch.tensor(tuple(cu_seqlens_host), dtype=torch.long) if cu_seqlens_host is not None
            else None)
    return {"cu_seqlens": cu_seqlens.to(device=device, dtype=torch.long),
            "cu_seqlens_cpu": host}


def gated_delta_arguments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: Sequence[int] | None,
    use_qk_l2norm_in_kernel: bool,
) -> dict[str, Any]:
    """The keywords of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` for token-major
    inputs (shapes as :func:`~prefix_sharing.recurrent.gated_delta.chunk_gated_delta_rule`).

    fla computes ``g`` and ``beta`` as given (no gate or sigmoid in the kernel), maps value
    head ``h`` to q/k head ``h // (HV // H)`` and defaults ``scale`` to ``K ** -0.5`` as the
    torch kernel does; its initial and final states are float32 ``(N, HV, K, V)``.
    """
    args = {name: x.unsqueeze(0) for name, x in
            (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))}  # [1, total, ...]
    args.update(
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        **_boundaries(cu_seqlens, cu_seqlens_host, q.device),
    )
    return args


def chunk_gated_delta_rule_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunked gated delta rule; arguments as :func:`gated_delta_arguments`."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(**gated_delta_arguments(q, k, v, g, beta, **kwargs))
    return out[0], final


def conv_arguments(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_inputs: torch.Tensor,
    *,
    activation: str | None,
    cu_seqlens: torch.Tensor,
    cu_seqlens_host: Sequence[int] | None,
) -> dict[str, Any]:
    """The keywords of ``fla.modules.causal_conv1d.causal_conv1d`` for one call over the
    plan's query segments.

    Args:
        x: ``(total, D)``.
        weight: ``(D, W)``; bias ``(D,)`` or ``None``.
        initial_inputs: ``(M, W - 1, D)``, per segment the inputs of the ``W - 1`` tokens
            before its first row (oldest first, zeros before the sequence starts).
        activation: ``None`` or ``"silu"``/``"swish"``.
        cu_seqlens, cu_seqlens_host: the ``M`` segments' boundaries.

    fla's initial state is ``(M, D, W)``: position ``W + i`` holds the input ``i`` steps
    before the segment (``i = -1 .. -(W-1)``), so column 0 is never read and stays zero.
    """
    states = torch.cat([initial_inputs.new_zeros(initial_inputs.size(0), 1, x.size(1)),
                        initial_inputs], 1).transpose(1, 2)  # [M, D, W]
    return dict(x=x.unsqueeze(0), weight=weight, bias=bias, initial_state=states.contiguous(),
                output_final_state=False, activation=activation,
                **_boundaries(cu_seqlens, cu_seqlens_host, x.device))


def causal_conv1d_fla(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      initial_inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """fla's varlen causal convolution; arguments as :func:`conv_arguments`."""
    from fla.modules.causal_conv1d import causal_conv1d

    out, _ = causal_conv1d(**conv_arguments(x, weight, bias, initial_inputs, **kwargs))
    return out[0]
