"""The recurrence schedule of a plan: in which order, and from which state, recurrent layers run.

A recurrent layer (Gated DeltaNet, Mamba) carries a state from token to token. Under sharing a
reuser's tail must start from its provider's state *at the branch point*, and that point can lie
inside the provider's own tail (a tree branching in a response, a chain extending a step). So the
computed rows are cut into **pieces** at every branch point: a piece is a run of consecutive
flat rows of one query segment, and its initial state is the final state of its **parent** piece
(the piece ending at the row just before it on its path), or zero when its path starts with it.
Pieces are grouped by depth (a parentless piece has depth 0, a child one more than its parent),
so all parents of bucket ``d`` lie in bucket ``d - 1`` and each bucket is one varlen kernel call
with one initial state per piece. Every computed row is in exactly one piece: each shared token
is computed once in the recurrent layers too.

Worked example (the plan's own: ``a = [5 6 7 8]``, ``b = [5 6 7 9 9]``, ``c = [5 6]``)::

    flat rows       0 1 2 3 | 4 5          a's segment computes rows 0-3, b's rows 4-5
    b branches after row 2 (its prefix is a's rows 0-2), so a's segment is cut there:
    pieces          [0 1 2] [3] [4 5]      piece 0 (depth 0), piece 1 and 2 (parent 0, depth 1)
    buckets         d=0: rows [0 1 2], cu_seqlens (0, 3)
                    d=1: rows [3 4 5], cu_seqlens (0, 1, 3), parent_index [0 0]

The short causal convolution needs no state passing: its output at a token reads the inputs of
the ``W - 1`` tokens before it on the token's own sequence, and those inputs are per-token
projections computed at the flat rows that hold those tokens (the provider's rows for a prefix).
So :meth:`RecurrenceSchedule.conv_predecessors` gives, for every computed row, the rows of its
``W - 1`` predecessors along its path (``-1`` before the sequence starts), and the convolution is
one gather: exact, differentiable, with no dependency order at all.

The schedule is host work done once per micro-batch (one copy of ``kv_gather_index`` to the
host); a layer reads only its tensors and host ints, so no layer syncs with the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..memo import derived
from ..plan import SharingPlan

__all__ = ["Piece", "RecurrenceBucket", "RecurrenceSchedule", "build_schedule",
           "recurrence_schedule"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Flat rows ``start..end-1`` of one query segment, run from ``parent``'s final state.

    Attributes:
        start, end: the piece's flat rows (``end`` exclusive).
        segment: the query segment the rows belong to.
        parent: index of the piece whose final state is this piece's initial state; -1 when
            the piece starts its sequence (zero initial state).
        depth: 0 without a parent, else the parent's depth plus one: the piece's bucket.
    """

    start: int
    end: int
    segment: int
    parent: int
    depth: int


@dataclasses.dataclass(frozen=True, eq=False)
class RecurrenceBucket:
    """The pieces of one depth: one varlen kernel call.

    Attributes:
        rows: ``(n_rows,)`` int64, the flat rows of the bucket's pieces, piece after piece
            (``x_bucket = x_flat.index_select(0, rows)``).
        cu_seqlens: ``(n_pieces + 1,)`` int32, the pieces' boundaries inside ``rows``.
        cu_seqlens_host: the same boundaries as host ints.
        max_seqlen: the longest piece.
        parent_index: ``(n_pieces,)`` int64, for each piece the position of its parent among
            the previous bucket's pieces (their final states, in order); ``None`` in bucket 0,
            whose pieces all start from a zero state.
        pieces: the global indices of the bucket's pieces (see :attr:`RecurrenceSchedule.pieces`).
    """

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: tuple[int, ...]
    max_seqlen: int
    parent_index: torch.Tensor | None
    pieces: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class RecurrenceSchedule:
    """Buckets of pieces, and what a recurrent layer needs to reassemble the flat layout.

    Attributes:
        pieces: every piece, in flat-row order.
        buckets: the depth buckets, depth 0 first.
        inverse_order: ``(T_flat,)`` int64: bucket outputs concatenated, then
            ``index_select(0, inverse_order)`` puts them back in flat-row order; ``None`` when
            the concatenation already is in flat order (no cut, one bucket).
        cu_seqlens, cu_seqlens_host: the plan's query segments (a convolution kernel that
            takes initial states runs once over them).
        num_rows: ``T_flat``.
    """

    pieces: tuple[Piece, ...]
    buckets: tuple[RecurrenceBucket, ...]
    inverse_order: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_host: tuple[int, ...]
    num_rows: int
    _paths: tuple[np.ndarray, ...]  # kv_gather_index, cu_q, cu_kv, segment of each row, prefix

    def conv_predecessors(self, width: int) -> torch.Tensor:
        """``(T_flat, width - 1)`` int64: for every flat row the rows of the ``width - 1``
        tokens before it on its own path, oldest first; ``-1`` where the sequence has not
        started. Built once per schedule and width (:mod:`prefix_sharing.memo`)."""
        if width < 1:
            raise ValueError(f"a convolution kernel width must be >= 1; got {width}")
        return derived(self, _conv_predecessors, width)

    def segment_conv_states(self, width: int) -> torch.Tensor:
        """``(M, width - 1)`` int64: the predecessors of each query segment's first row, the
        rows whose inputs form the segment's initial convolution state (``-1``: zeros)."""
        starts = torch.tensor(self.cu_seqlens_host[:-1], dtype=torch.long,
                              device=self.cu_seqlens.device)
        return self.conv_predecessors(width).index_select(0, starts)


def _conv_predecessors(schedule: RecurrenceSchedule, width: int) -> torch.Tensor:
    return torch.from_numpy(_predecessors(*schedule._paths, width)).to(schedule.cu_seqlens.device)


def recurrence_schedule(plan: SharingPlan) -> RecurrenceSchedule:
    """The schedule of ``plan``, built on first use and then reused by every layer (each
    micro-batch's plan is built once and read by all layers; the schedule is freed with it,
    :mod:`prefix_sharing.memo`)."""
    return derived(plan, build_schedule)


def build_schedule(plan: SharingPlan) -> RecurrenceSchedule:
    """Cuts ``plan``'s computed rows at every branch point and buckets the pieces by depth.

    Raises:
        ValueError: the plan has external rows (its recurrence would start from a state no
            block kept), or its key paths are inconsistent (a reuser's prefix is not the path
            of the row it branches from), which no plan from the planner has.
    """
    if plan.external_rows:
        raise ValueError(
            f"a plan with {plan.external_rows} external K/V rows (a micro-batch of a group "
            "across micro-batches) has no recurrence: a recurrent layer's state at a shared "
            "block's end is not among what the block hands its readers; run the group in one "
            "micro-batch (cross_micro_batch off)")
    device = plan.kv_index.device
    cu_q = np.asarray(plan.cu_seqlens_q_host, dtype=np.int64)
    cu_kv = np.asarray(plan.cu_seqlens_kv_host, dtype=np.int64)
    gather = plan.kv_gather_index.detach().cpu().numpy().astype(np.int64)
    q_lens, prefix = np.diff(cu_q), np.diff(cu_kv) - np.diff(cu_q)
    segment_of_row = np.repeat(np.arange(len(q_lens)), q_lens)
    branch_rows = gather[cu_kv[:-1] + prefix - 1][prefix > 0]  # the row each reuser follows
    _check_paths(gather, cu_q, cu_kv, prefix, segment_of_row)

    # piece boundaries: every segment start, and after every row some reuser branches from
    bounds = np.unique(np.concatenate([cu_q, branch_rows + 1]))
    starts, ends = bounds[:-1], bounds[1:]
    piece_of_row = np.repeat(np.arange(len(starts)), ends - starts)
    parents = np.arange(len(starts)) - 1  # a cut piece continues the piece before it...
    first = np.isin(starts, cu_q[:-1])
    seg = segment_of_row[starts]
    parents[first] = -1  # ...a segment's first piece continues its branch row's piece
    with_prefix = first & (prefix[seg] > 0)
    parents[with_prefix] = piece_of_row[gather[cu_kv[seg[with_prefix]] + prefix[seg[with_prefix]] - 1]]
    depths = _depths(parents)
    pieces = tuple(Piece(int(s), int(e), int(m), int(p), int(d))
                   for s, e, m, p, d in zip(starts, ends, seg, parents, depths))

    buckets, order, position = [], [], np.zeros(len(pieces), dtype=np.int64)
    for depth in range(int(depths.max(initial=-1)) + 1):
        members = np.flatnonzero(depths == depth)
        position[members] = np.arange(len(members))
        lens = ends[members] - starts[members]
        rows = np.concatenate([np.arange(starts[i], ends[i]) for i in members])
        order.append(rows)
        cu = tuple(int(x) for x in np.concatenate([[0], np.cumsum(lens)]))
        parent_index = None if depth == 0 else torch.from_numpy(position[parents[members]]).to(device)
        buckets.append(RecurrenceBucket(
            rows=torch.from_numpy(rows).to(device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            cu_seqlens_host=cu, max_seqlen=int(lens.max()), parent_index=parent_index,
            pieces=tuple(int(i) for i in members)))
    flat_order = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    inverse = None
    if not np.array_equal(flat_order, np.arange(len(flat_order))):
        inverse = torch.from_numpy(np.argsort(flat_order)).to(device)
    return RecurrenceSchedule(
        pieces=pieces, buckets=tuple(buckets), inverse_order=inverse,
        cu_seqlens=plan.cu_seqlens_q, cu_seqlens_host=tuple(plan.cu_seqlens_q_host),
        num_rows=plan.num_tokens_flat, _paths=(gather, cu_q, cu_kv, segment_of_row, prefix))


def _check_paths(gather: np.ndarray, cu_q: np.ndarray, cu_kv: np.ndarray, prefix: np.ndarray,
                 segment_of_row: np.ndarray) -> None:
    """A reuser's prefix must be the whole path of the row it branches from: then that row's
    state is the reuser's initial state (the invariant the planner's layout guarantees)."""
    for m in np.flatnonzero(prefix > 0):
        path = gather[cu_kv[m]: cu_kv[m] + prefix[m]]
        row = path[-1]
        p = segment_of_row[row]
        row_path = gather[cu_kv[p]: cu_kv[p] + prefix[p] + row - cu_q[p] + 1]
        if not np.array_equal(path, row_path):
            raise ValueError(f"inconsistent plan: query segment {m}'s prefix is not the path of "
                             f"flat row {row}, which it branches from")


def _depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every piece (its number of ancestors); the parent links form a forest."""
    depths = np.full(len(parents), -1, dtype=np.int64)
    for i in range(len(parents)):
        chain = []
        j = i
        while depths[j] < 0 and parents[j] >= 0:
            chain.append(j)
            j = parents[j]
            if len(chain) > len(parents):
                raise ValueError("inconsistent plan: the branch points form a cycle")
        if depths[j] < 0:
            depths[j] = 0
        for k in reversed(chain):
            depths[k] = depths[parents[k]] + 1
    return depths


def _predecessors(gather: np.ndarray, cu_q: np.ndarray, cu_kv: np.ndarray, seg: np.ndarray,
                  prefix: np.ndarray, width: int) -> np.ndarray:
    # a row's position on its path: its segment's prefix plus its offset in the segment's tail
    position = prefix[seg] + np.arange(len(seg)) - cu_q[seg]  # [T]
    back = position[:, None] - np.arange(width - 1, 0, -1)[None, :]  # [T, W-1], oldest first
    picked = gather[cu_kv[seg][:, None] + np.maximum(back, 0)]
    return np.where(back >= 0, picked, -1).astype(np.int64)
