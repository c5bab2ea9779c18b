"""The chunked gated delta rule over a whole recurrence schedule in one pass (torch backend).

The bucket-by-bucket run (:func:`~.gated_delta.gated_delta_rule_over_schedule` with fla) makes
one kernel call per depth, each with its own intra-chunk work; on a CPU the per-call cost of
those calls, not the tokens, dominates a small model's shared step. But only the scan over
chunks depends on the state; the intra-chunk products and triangular solves
(:mod:`.torch_kernels`) depend on a chunk's own tokens. So here every piece of the schedule is
cut into chunks of its own (no piece padded to a bucket's longest), the intra-chunk work runs
once for all of them, and one scan follows the forest: a piece's chunks take the steps after
its parent's last chunk, so at each step the live chunks are one per live piece, and a piece's
first chunk starts from its parent's state (``index_select``: differentiable, the reusers'
gradients flow into the provider's chunks). The scan is as long as the longest root-to-leaf
path in chunks - about the plain run's longest sequence.

:class:`ForestLayout` is host work done once per micro-batch and chunk size (cached on the
schedule by :mod:`.gated_delta`); a layer reads its tensors and host ints only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .schedule import Piece
from .torch_kernels import intra_chunk, prepare

__all__ = ["ForestLayout", "gated_delta_rule_forest"]


class ForestLayout:
    """The chunks of a schedule's pieces in scan order.

    Attributes:
        size: the chunk size ``C``: ``chunk_size``, or less when every piece is shorter (the
            longest piece rounded up to a power of two).
        chunk_rows: ``(M, C)`` flat rows of every chunk, step after step (rows past a piece's
            end read ``total``: an appended zero row, which leaves the state unchanged).
        offsets: ``S + 1`` host ints, the chunks of step ``s`` are ``offsets[s]:offsets[s+1]``.
        sources: per step, ``None`` when its live pieces are the previous step's, in order,
            else ``(n_s,)`` int64: for each live piece the previous step's position of itself
            (a continuing piece) or of its parent (a piece's first chunk).
        num_roots: the pieces live at step 0 (the parentless ones; zero states).
        keep: ``(total,)`` the position in ``[M * C]`` of every flat row.
    """

    def __init__(self, pieces: Sequence[Piece], total: int, chunk_size: int,
                 device: torch.device) -> None:
        longest = max((p.end - p.start for p in pieces), default=1)
        self.size = size = min(chunk_size, 1 << max(0, longest - 1).bit_length())
        counts = [-(-(p.end - p.start) // size) for p in pieces]
        first_step = [0] * len(pieces)
        for i in sorted(range(len(pieces)), key=lambda i: pieces[i].depth):
            parent = pieces[i].parent
            first_step[i] = 0 if parent < 0 else first_step[parent] + counts[parent]
        steps = max((f + c for f, c in zip(first_step, counts)), default=0)
        live = [[] for _ in range(steps)]  # per step: (piece, chunk within the piece)
        for i, (f, c) in enumerate(zip(first_step, counts)):
            for j in range(c):
                live[f + j].append((i, j))
        rows, keep = [], [0] * total
        self.offsets, self.sources = [0], []
        previous: dict[int, int] = {}
        for s, chunks in enumerate(live):
            position = {}
            for n, (i, j) in enumerate(chunks):
                start = pieces[i].start + j * size
                end = min(pieces[i].end, start + size)
                base = (len(rows)) * size
                for r in range(start, end):
                    keep[r] = base + r - start
                rows.append(list(range(start, end)) + [total] * (size - (end - start)))
                position[i] = n
            src = [previous[i] if j else previous.get(pieces[i].parent, -1) for i, j in chunks]
            same = s == 0 or (len(src) == len(previous) and src == list(range(len(src))))
            self.sources.append(None if same else torch.tensor(src, device=device))
            self.offsets.append(len(rows))
            previous = position
        self.num_roots = len(live[0]) if live else 0
        self.chunk_rows = torch.tensor(rows, dtype=torch.long, device=device).view(-1, size)
        self.keep = torch.tensor(keep, dtype=torch.long, device=device)


def gated_delta_rule_forest(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: ForestLayout,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """The gated delta rule of a schedule's flat rows (shapes as
    :func:`~.torch_kernels.chunk_gated_delta_rule_torch`), every piece from its parent's
    state; returns ``(total, HV, V)`` in v's dtype, in flat-row order."""
    out_dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [total, HV, ...] -> [M, HV, C, ...]
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[layout.chunk_rows].movedim(1, 2)

    parts = intra_chunk(*(chunked(x) for x in (q, k, v, g, beta)))
    state = q.new_zeros(layout.num_roots, v.size(1), q.size(2), v.size(2))  # [n, HV, K, V]
    outs = []
    for s, source in enumerate(layout.sources):
        a, b = layout.offsets[s], layout.offsets[s + 1]
        if source is not None:
            state = state.index_select(0, source)
        u = parts.writes[a:b] - parts.state_reads[a:b] @ state  # [n, HV, C, V]
        outs.append(parts.q_decayed[a:b] @ state + parts.scores[a:b] @ u)
        state = state * parts.chunk_decay[a:b] + parts.k_decayed[a:b] @ u
    out = torch.cat(outs).movedim(1, 2).flatten(0, 1)  # [M * C, HV, V]
    return out.index_select(0, layout.keep).to(out_dtype)
