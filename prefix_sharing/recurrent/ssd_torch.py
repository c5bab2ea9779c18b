"""Pure-torch Mamba-2 (SSD) scan kernels (any device, CPU included): the reference backend.

The state-space recurrence of a Mamba-2 mixer, per head ``h`` with a state ``S`` of shape
``(P, N)`` (head dim x state size) and ``B``/``C`` shared by the heads of one group::

    S <- exp(dt_t * A_h) * S + dt_t * x_t B_t^T      scalar decay, rank-one write
    y_t = S C_t + D_h * x_t                          read, plus the skip

``dt`` is taken as given (already biased, softplus-ed and clamped, see :func:`discretize_dt`),
so a padding token with ``dt = x = 0`` leaves the state unchanged.

:func:`ssd_recurrent` runs it token by token (the readable reference); :func:`chunk_ssd_torch`
computes the same thing chunk by chunk. Inside a chunk with ``gamma_i`` the cumulative log decay
since the chunk start and ``S0`` the state entering it,
``y_i = e^gamma_i S0 C_i + sum_{j<=i} e^(gamma_i - gamma_j) (C_i . B_j) dt_j x_j`` and the state
leaving it is ``e^gamma_C S0 + sum_j e^(gamma_C - gamma_j) dt_j x_j B_j^T``. Only the scan over
chunks is sequential; all sequences of a varlen call run together, padded to whole chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import InputError
from .torch_kernels import _padded, _padded_index

__all__ = ["chunk_ssd_torch", "discretize_dt", "ssd_recurrent"]


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *limit)``: the step sizes, as transformers' Mamba-2
    mixers and ``mamba_chunk_scan_combined(dt_softplus=True, dt_limit=limit)`` compute them."""
    return F.softplus(dt + dt_bias.to(dt.dtype)).clamp(min=limit[0], max=limit[1])


def _prepare(x, dt, A, B, C, D):
    """Compute dtype (float64 stays float64, else float32), B and C expanded to the heads."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    heads, groups = x.size(1), B.size(1)
    if heads % groups or C.shape != B.shape:
        raise InputError(f"SSD heads ({heads}) must be a multiple of the B/C groups ({groups}), "
                         f"and B {tuple(B.shape)} and C {tuple(C.shape)} alike")
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    # head h reads group h // (heads // groups)
    B, C = (t.repeat_interleave(heads // groups, dim=1) for t in (B, C))  # [T, H, N]
    skip = None if D is None else D.to(dtype)[:, None] * x  # [T, H, P]
    return x, dt, A, B, C, skip


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens_host: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence token by token: the reference the chunked kernels are checked on.

    Same arguments as :func:`chunk_ssd_torch`; always returns the final states. All sequences
    step together (padded with state-preserving ``dt = 0`` tokens), one token per step.
    """
    out_dtype = x.dtype
    x, dt, A, B, C, skip = _prepare(x, dt, A, B, C, D)
    index, keep = _padded_index(cu_seqlens_host, x.size(0), 1, x.device)
    x, dt, B, C = (_padded(t, index) for t in (x, dt, B, C))  # [N, L, H, ...]
    state = (x.new_zeros(x.size(0), x.size(2), x.size(3), B.size(3)) if initial_state is None
             else initial_state.to(x.dtype))  # [N, H, P, N]
    outs = []
    for t in range(x.size(1)):
        decay = (dt[:, t] * A).exp()[..., None, None]  # [N, H, 1, 1]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outs.append(torch.einsum("nhpk,nhk->nhp", state, C[:, t]))
    out = torch.stack(outs, 1).flatten(0, 1).index_select(0, keep)
    if skip is not None:
        out = out + skip
    return out.to(out_dtype), state


def chunk_ssd_torch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens_host: Sequence[int] | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked SSD scan over varlen sequences, each from its own initial state.

    Args:
        x: ``(total, H, P)`` the scan's inputs.
        dt: ``(total, H)`` step sizes, ``>= 0`` (discretized: :func:`discretize_dt`).
        A: ``(H,)`` negative decay rates (``-exp(A_log)``).
        B, C: ``(total, G, N)``; ``H`` a multiple of ``G`` (head ``h`` reads group
            ``h // (H // G)``).
        D: ``(H,)`` skip weights, or ``None``.
        initial_state: ``(num_seqs, H, P, N)``, one per sequence; zeros when ``None``.
        output_final_state: also return each sequence's final state.
        cu_seqlens_host: ``num_seqs + 1`` host ints; one sequence when ``None``.
        chunk_size: tokens per chunk at most; shrinks to the longest sequence rounded up to a
            power of two when every sequence is shorter.

    Returns:
        ``(y, final_state)``: ``y`` ``(total, H, P)`` in x's dtype, ``final_state``
        ``(num_seqs, H, P, N)`` in the compute dtype (float32, float64 for float64 inputs) or
        ``None``. Differentiable in every input, the initial state included.
    """
    out_dtype = x.dtype
    x, dt, A, B, C, skip = _prepare(x, dt, A, B, C, D)
    bounds = tuple(cu_seqlens_host) if cu_seqlens_host is not None else (0, x.size(0))
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=1)
    size = min(chunk_size, 1 << max(0, longest - 1).bit_length())
    heads, head_dim, state_dim = x.size(1), x.size(2), B.size(2)
    index, keep = _padded_index(bounds, x.size(0), size, x.device)
    num_seqs, num_chunks = index.size(0), index.size(1) // size

    def chunked(t: torch.Tensor) -> torch.Tensor:
        # [total, H, ...] -> [N, H, num_chunks, C, ...]
        t = _padded(t, index)
        return t.view(num_seqs, num_chunks, size, *t.shape[2:]).movedim(3, 1)

    x, dt, B, C = (chunked(t) for t in (x, dt, B, C))
    gamma = (dt * A[:, None, None]).cumsum(-1)  # [N, H, nc, C], log decay from the chunk start
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    scores = (C @ B.transpose(-1, -2)) * decay  # [N, H, nc, C, C]
    xdt = x * dt[..., None]  # [N, H, nc, C, P]
    intra = scores @ xdt  # [N, H, nc, C, P]
    c_decayed = C * gamma.exp()[..., None]  # [N, H, nc, C, N]
    writes = (xdt * (gamma[..., -1:] - gamma).exp()[..., None]).transpose(-1, -2) @ B  # [.., P, N]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [N, H, nc, 1, 1]

    state = (x.new_zeros(num_seqs, heads, head_dim, state_dim) if initial_state is None
             else initial_state.to(x.dtype))
    outs = []
    for c in range(num_chunks):
        outs.append(intra[:, :, c] + c_decayed[:, :, c] @ state.transpose(-1, -2))
        state = state * chunk_decay[:, :, c] + writes[:, :, c]
    out = torch.stack(outs, 2).movedim(1, 3).flatten(0, 2)  # [N * L, H, P]
    out = out.index_select(0, keep)
    if skip is not None:
        out = out + skip
    return out.to(out_dtype), state if output_final_state else None
