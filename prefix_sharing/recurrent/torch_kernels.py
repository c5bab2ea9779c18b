"""Pure-torch Gated DeltaNet kernels (any device, CPU included): the reference backend.

The gated delta rule, per value head, with state ``S`` of shape ``(K, V)``::

    S <- exp(g_t) * S                            decay
    u_t = beta_t * (v_t - S^T k_t)               the part of v_t the state does not predict
    S <- S + k_t u_t^T                           delta-rule write
    o_t = S^T (scale * q_t)                      read

:func:`gated_delta_rule_recurrent` runs it token by token (the readable reference);
:func:`chunk_gated_delta_rule_torch` computes the same thing chunk by chunk. Inside a chunk of
``C`` tokens with ``gamma_i`` the cumulative log decay since the chunk start and ``S0`` the
state entering it, the writes solve the unit lower-triangular system
``(I + A) U = beta V - diag(beta e^gamma) K S0`` with
``A_ij = beta_i e^(gamma_i - gamma_j) k_i.k_j`` (``j < i``); then
``O = (Q e^gamma) S0 + (QK^T * D) U`` with ``D_ij = e^(gamma_i - gamma_j)`` (``j <= i``) and the
state leaving the chunk is ``e^gamma_C S0 + (K e^(gamma_C - gamma))^T U``. Only the scan over
chunks is sequential; all sequences of a varlen call run together, padded to whole chunks with
``beta = k = v = 0, g = 0`` tokens, which leave the state unchanged.

:func:`causal_conv1d_torch` is the depthwise causal convolution as a gather over each row's
predecessors on its path (see :mod:`.schedule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import InputError

__all__ = ["chunk_gated_delta_rule_torch", "gated_delta_rule_recurrent", "causal_conv1d_torch",
           "l2_normalize", "prepare", "intra_chunk", "ChunkParts", "CHUNK_SIZE"]

L2_EPS = 1e-6  # fla's and transformers' epsilon inside the q/k L2 norm
# Tokens per chunk at most (fla's kernels use 64). Per token the intra-chunk work grows with the
# chunk while the sequential scan's steps shrink; on a CPU 32 measured faster than 16 and 64
# for plain and shared steps alike on the hybrid presets, and pads short pieces less.
CHUNK_SIZE = 32


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, as fla's ``use_qk_l2norm_in_kernel``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """Compute dtype (float64 stays float64, else float32), grouped heads expanded, q scaled."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads, value_heads = q.size(1), v.size(1)
    if value_heads % heads:
        raise InputError(f"value heads ({value_heads}) must be a multiple of q/k heads ({heads})")
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    if value_heads != heads:  # value head h reads q/k head h // (value_heads // heads)
        q, k = (x.repeat_interleave(value_heads // heads, dim=1) for x in (q, k))
    q = q * (q.size(-1) ** -0.5 if scale is None else scale)
    return q, k, v, g, beta


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens_host: Sequence[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token: the reference the chunked kernels are checked on.

    Same arguments as :func:`chunk_gated_delta_rule_torch`; always returns the final states.
    All sequences step together (padded, see :func:`_padded_index`), one token per step.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    index, keep = _padded_index(cu_seqlens_host, q.size(0), 1, q.device)
    q, k, v, g, beta = (_padded(x, index) for x in (q, k, v, g, beta))  # [N, L, HV, ...]
    state = (q.new_zeros(q.size(0), v.size(2), q.size(3), v.size(3)) if initial_state is None
             else initial_state.to(q.dtype))  # [N, HV, K, V]
    outs = []
    for t in range(q.size(1)):
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", state, q[:, t]))
    out = torch.stack(outs, 1).flatten(0, 1).index_select(0, keep)
    return out.to(out_dtype), state


def _padded_index(cu_seqlens_host: Sequence[int] | None, total: int, multiple: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [N, L], keep [total])``: each sequence's rows padded to a common length ``L``
    (a multiple of ``multiple``) with row ``total`` (an appended zero row), and the padded
    positions that hold real tokens, in token order. Built on the host: no device sync."""
    bounds = tuple(cu_seqlens_host) if cu_seqlens_host is not None else (0, total)
    if bounds[-1] != total:
        raise InputError(f"cu_seqlens ends at {bounds[-1]} but the inputs hold {total} tokens")
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    length = max(1, -(-max(lens, default=0) // multiple)) * multiple
    index = torch.full((len(lens), length), total, dtype=torch.long)
    keep = []
    for n, (start, size) in enumerate(zip(bounds[:-1], lens)):
        index[n, :size] = torch.arange(start, start + size)
        keep.append(torch.arange(n * length, n * length + size))
    return index.to(device), torch.cat(keep).to(device)


def _padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [total, ...]`` -> ``[N, L, ...]``, zeros past each sequence's end. Zero tokens
    (``g = beta = k = v = 0``) leave the state unchanged."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index]


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens_host: Sequence[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule over varlen sequences, each from its own initial state.

    Args:
        q, k: ``(total, H, K)``.
        v: ``(total, HV, V)``; ``HV`` a multiple of ``H`` (value head ``h`` reads q/k head
            ``h // (HV // H)``).
        g: ``(total, HV)``, log decays (``<= 0``).
        beta: ``(total, HV)``, write strengths.
        scale: multiplies q; ``K ** -0.5`` when ``None``.
        initial_state: ``(N, HV, K, V)``, one per sequence; zeros when ``None``.
        output_final_state: also return each sequence's final state.
        cu_seqlens_host: ``N + 1`` host ints, the sequences' boundaries; one sequence when
            ``None``.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        chunk_size: tokens per chunk at most; when every sequence is shorter, the chunk
            shrinks to the longest one rounded up to a power of two (short pieces of a
            schedule bucket are then not padded to a whole 64-token chunk; the result is the
            same rule, rounded differently).

    Returns:
        ``(o, final_state)``: ``o`` ``(total, HV, V)`` in v's dtype, ``final_state``
        ``(N, HV, K, V)`` in the compute dtype (float32, float64 for float64 inputs) or
        ``None``. Computed in float32 (float64 for float64 inputs); differentiable in every
        input, the initial state included.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    bounds = tuple(cu_seqlens_host) if cu_seqlens_host is not None else (0, q.size(0))
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=1)
    size = min(chunk_size, 1 << max(0, longest - 1).bit_length())
    value_heads, key_dim, value_dim = v.size(1), q.size(2), v.size(2)
    layout = _ChunkLayout(bounds, q.size(0), size, q.device)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [total, HV, ...] -> [M, HV, C, ...]: the real chunks only, no sequence padded to
        # the longest
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[layout.chunk_rows]  # [M, C, HV, ...]
        return x.movedim(1, 2)

    parts = intra_chunk(*(chunked(x) for x in (q, k, v, g, beta)))
    # the scan's grid [N, nc, ...]: chunk c of every sequence, an empty chunk (no write, no
    # output, no decay) where a sequence has fewer chunks
    writes, state_reads, scores, q_decayed, k_decayed = (
        layout.grid(x) for x in (parts.writes, parts.state_reads, parts.scores,
                                 parts.q_decayed, parts.k_decayed))
    chunk_decay = layout.grid(parts.chunk_decay, fill=1.0)  # [N, nc, HV, 1, 1]

    state = (q.new_zeros(layout.num_seqs, value_heads, key_dim, value_dim)
             if initial_state is None else initial_state.to(q.dtype))
    outs = []
    for c in range(layout.num_chunks):
        u = writes[:, c] - state_reads[:, c] @ state  # [N, HV, C, V]
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ u)
        state = state * chunk_decay[:, c] + k_decayed[:, c] @ u
    out = torch.stack(outs, 1).movedim(2, 3).flatten(0, 2)  # [N * nc * C, HV, V]
    out = out.index_select(0, layout.keep)
    return out.to(out_dtype), state if output_final_state else None


class _ChunkLayout:
    """Where the chunks of varlen sequences lie, built on the host once per call.

    Attributes:
        chunk_rows: ``(M, C)`` rows of each real chunk (``total``, an appended zero row, past
            a sequence's end); sequence after sequence, chunk after chunk.
        num_seqs, num_chunks: ``N`` and the most chunks of a sequence, ``nc``.
        keep: ``(total,)`` the grid positions (``[N, nc, C]`` flattened) of the tokens, in
            token order.
    """

    def __init__(self, bounds: tuple[int, ...], total: int, size: int,
                 device: torch.device) -> None:
        index, self.keep = _padded_index(bounds, total, size, device)  # [N, nc * C]
        self.num_seqs, self.num_chunks = index.size(0), index.size(1) // size
        counts = [-(-(b - a) // size) for a, b in zip(bounds[:-1], bounds[1:])]
        real = [n * self.num_chunks + c for n, count in enumerate(counts) for c in range(count)]
        grid_cells = self.num_seqs * self.num_chunks
        self._to_grid = None  # every sequence has nc chunks: the chunks are the grid
        if len(real) != grid_cells:
            to_grid = torch.full((grid_cells,), len(real), dtype=torch.long)
            to_grid[real] = torch.arange(len(real))
            self._to_grid = to_grid.to(device)
            index = index.view(grid_cells, size)[torch.tensor(real, device=device)]
        self.chunk_rows = index.view(-1, size)

    def grid(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[M, ...]`` per chunk -> ``[N, nc, ...]``, ``fill`` in the empty chunks."""
        if self._to_grid is not None:
            x = torch.cat([x, x.new_full((1, *x.shape[1:]), fill)]).index_select(0, self._to_grid)
        return x.view(self.num_seqs, self.num_chunks, *x.shape[1:])


class ChunkParts(NamedTuple):
    """What a chunk contributes to the scan, whatever state enters it (shapes per chunk):
    ``writes`` ``[.., C, V]`` and ``state_reads`` ``[.., C, K]`` (``U = writes - state_reads
    @ S0``), ``scores`` ``[.., C, C]`` and ``q_decayed`` ``[.., C, K]`` (``O = q_decayed @ S0
    + scores @ U``), ``k_decayed`` ``[.., K, C]`` and ``chunk_decay`` ``[.., 1, 1]`` (the
    state leaving: ``chunk_decay * S0 + k_decayed @ U``)."""

    writes: torch.Tensor
    state_reads: torch.Tensor
    scores: torch.Tensor
    q_decayed: torch.Tensor
    k_decayed: torch.Tensor
    chunk_decay: torch.Tensor


def intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> ChunkParts:
    """The state-free work of chunks ``[.., C, ...]`` (q, k ``[.., C, K]``, v ``[.., C, V]``,
    g, beta ``[.., C]``; q prepared: scaled, normalised, heads expanded); see the module doc
    for the system solved."""
    size = q.size(-2)
    gamma = g.cumsum(-1)  # [.., C], log decay from the chunk start
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    system = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(size, dtype=q.dtype, device=q.device)
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False,
                                           unitriangular=True)  # [.., C, V]
    state_reads = torch.linalg.solve_triangular(
        system, (beta * gamma.exp())[..., None] * k, upper=False, unitriangular=True)  # [.., C, K]
    return ChunkParts(
        writes=writes, state_reads=state_reads,
        scores=(q @ k.transpose(-1, -2)) * decay,  # [.., C, C]
        q_decayed=q * gamma.exp()[..., None],
        k_decayed=(k * (gamma[..., -1:] - gamma).exp()[..., None]).transpose(-1, -2),
        chunk_decay=gamma[..., -1].exp()[..., None, None])


_ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    predecessors: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution of every row with the rows before it on its path.

    ``out[t] = act(bias + sum_w weight[:, w] * x[p_w(t)])`` where ``p_{W-1}(t) = t`` and
    ``p_0..p_{W-2}`` are ``predecessors[t]`` (oldest first, ``-1`` reads zeros): with the
    plain layout that is ``F.conv1d(padding=W-1, groups=D)`` cut to causal.

    Args:
        x: ``(total, D)``.
        weight: ``(D, W)``.
        bias: ``(D,)`` or ``None``.
        predecessors: ``(total, W - 1)`` int64 rows of ``x`` (see
            :meth:`~prefix_sharing.recurrent.schedule.RecurrenceSchedule.conv_predecessors`).
        activation: ``None``, ``"silu"`` or ``"swish"``.

    Returns:
        ``(total, D)`` in x's dtype, differentiable (the gather's backward scatter-adds).
    """
    if activation not in _ACTIVATIONS:
        raise InputError(f"causal conv activation {activation!r} is not one of "
                         f"{sorted(a for a in _ACTIVATIONS if a)} or None")
    width, weight_dtype = weight.size(1), weight.dtype
    if predecessors.shape != (x.size(0), width - 1):
        raise InputError(f"predecessors must be ({x.size(0)}, {width - 1}); "
                         f"got {tuple(predecessors.shape)}")
    # accumulate in float32 at least and round once to the weight's dtype, as F.conv1d does
    compute = torch.promote_types(weight.dtype, torch.float32)
    weight = weight.to(compute)
    padded = torch.cat([x.new_zeros(1, x.size(1)), x]).to(compute)  # row 0: zeros
    out = x.to(compute) * weight[:, -1]
    for w in range(width - 1):
        out = out + padded.index_select(0, predecessors[:, w] + 1) * weight[:, w]
    if bias is not None:
        out = out + bias.to(compute)
    return _ACTIVATIONS[activation](out.to(weight_dtype)).to(x.dtype)
