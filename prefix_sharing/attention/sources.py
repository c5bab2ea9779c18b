"""How a plan's attention runs, chosen once per plan on the host, and its key-source layout.

Four executions compute the same attention (every computed token over all earlier tokens of
its own sequence):

- ``"in_place"``: no segment reads a prefix (the identity plan; chains of strict prefixes):
  one varlen call over K/V as they are.
- ``"sources"``: every query row attends to its own segment's rows causally (one call) and to
  each *shared node* it reads - a run of flat rows that a set of segments all read as prefix -
  with no mask, since a node lies wholly before each reader's tail (one call over all nodes:
  the dense rectangle of each node's readers over its keys). Both calls read K/V in place (the
  rows between nodes are segments without queries), and the partial results merge exactly by
  their log-sum-exp (:mod:`.merge`). K/V held per layer: the computed rows, ``T_flat``.
- ``"tree_mask"``: one FlexAttention call over the flat rows, the plan's tree as its mask
  (:mod:`.flex_backend`): K/V in place, no merge. K/V held per layer: ``T_flat``.
- ``"gather"``: each segment's keys copied together (``index_select`` through
  ``kv_gather_index``): K/V held per layer is every sequence's full key range that owns a
  tail, the total token count when every sequence owns one.

A plan with ``external_rows`` (a suffix micro-batch across micro-batches, its stack of stored
blocks in front of its own rows) adds one more key source per stored block under
``"sources"``: the dense rectangle of *all* its query rows over the block's stored K/V, no mask
(every stored row precedes every query), read in place from the store
(:class:`~prefix_sharing.prefix_kv.PrefixKV`) and merged with the rest by the
log-sum-exp: no ``cat(stored, own)``, no gather (under a sliding window only the rows whose
window reaches a block read it, each from its first key, as for a node). Under ``"gather"``
the caller's stored K/V are concatenated in front of the flat rows, as ``kv_gather_index``
addresses them.

A context-parallel rank holds the query rows of a slice of the flat layout and, all-gathered,
K/V of every row: ``source_layout(plan, rows=(lo, hi))`` lays out the same two parts for the
slice's rows (its own pieces over their segments' rows up to the last local query, bottom-right
causal; the local rows of each node's readers over the node), every peer's rows read in place.

The rule (:func:`choose_execution`), in order:

1. K/V handed as one tensor of other rows than the plan's flat rows (a caller that
   concatenated a stored prefix itself), or stored sources that do not add up to the plan's
   ``external_rows``: ``"gather"``.
2. No segment reads a prefix (nor a stored one): ``"in_place"``.
   FlexAttention (backend ``"flex"``) without stored rows: ``"tree_mask"`` (it has no
   backward at a given output and log-sum-exp, so it merges nothing, and needs not to).
3. The backend has no with-lse kernel (:data:`~.backends.LSE_KERNELS`), or the plan no
   ``prefix_runs_host``: ``"gather"``.
4. A sliding window of ``w`` keys that cuts a node, on a kernel without a first key per row
   (:data:`~.backends.ROW_KEY_BOUNDS`: flash-attn, TE, torch_npu): ``"gather"``, trimmed to
   the window (:mod:`.window`). Over sources, a reader's query at position ``p`` reads a
   node's key at position ``j`` only if ``j >= p - w + 1``: a bound that depends on each
   reader's distance from the node, and a node's readers are stacked in one segment, so the
   layout gives every row of the node part its own first key
   (:attr:`~.merge.KeyPart.first_key`), and leaves out the rows past ``node end + w - 1``,
   which read none of the node's keys (for a row with every key masked, aten's kernel
   returns out 0 and lse 0, not -inf, which the merge would count as a softmax term of
   weight 1; torch 2.13). The own part takes the window as its band. flash-attn's, TE's and
   torch_npu's bands are one ``(left, right)`` per call, aligned bottom-right per segment:
   each distinct distance would need a call of its own. A node call's keys start at the
   first one a kept row reads, so a window that leaves every kept row the same keys (the
   whole node, or its last key alone) bounds nothing there and runs over sources on every
   with-lse kernel.
5. Otherwise ``"sources"`` (GRPO groups, agent branches, trees, chains with reads), even
   for short reads: it then holds no K/V beyond the computed rows for one more call and the
   merge. (Whether a gather of a few rows beats that on an accelerator is a timing question
   for a GPU run; until measured, the rule keeps K/V at the computed size.)

Worked example, the plan of :class:`~prefix_sharing.plan.SharingPlan` (``b`` reads ``a``'s
rows 0..2): one node ``(0, 3)`` read by ``b``'s tail, rows 4 and 5::

    own part:   cu_seqlens_q = cu_seqlens_k = [0 4 6]        causal, K/V in place
    node part:  q_index = [4 5]   cu_seqlens_q = [0 2 2]     no mask, K/V in place:
                                  cu_seqlens_k = [0 3 6]     node 0..2, then rows 3..5 unread
    slots:      rows 0-3 -> [2] (none), row 4 -> [0], row 5 -> [1]
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np
import torch

from ..memo import derived
from ..plan import SharingPlan
from .backends import LSE_KERNELS, ROW_KEY_BOUNDS
from .merge import KeyPart, SourceLayout
from .window import windowed_keys

__all__ = [
    "EXECUTIONS",
    "KeyRows",
    "choose_execution",
    "key_rows",
    "runnable_layout",
    "source_layout",
]

EXECUTIONS = ("in_place", "sources", "tree_mask", "gather")


def choose_execution(plan: SharingPlan, key_rows_given: int, window: int | None,
                     backend: str, stored_rows: tuple[int, ...] = ()) -> str:
    """The execution of the rule above for ``plan`` with K/V of ``key_rows_given`` rows (and
    stored sources of ``stored_rows`` rows each), a ``window`` (or ``None``) and a concrete
    ``backend``. Host ints only."""
    if key_rows_given != plan.num_tokens_flat or sum(stored_rows) != plan.external_rows:
        return "gather"
    if not plan.has_kv_gather:
        return "in_place"
    if backend == "flex":
        return "tree_mask" if source_layout(plan) is not None else "gather"
    if runnable_layout(plan, backend, stored_rows, window=window) is None:
        return "gather"
    return "sources"


def runnable_layout(plan: SharingPlan, backend: str, stored_rows: tuple[int, ...] = (),
                    rows: tuple[int, int] | None = None,
                    window: int | None = None) -> SourceLayout | None:
    """:func:`source_layout` where ``backend`` can run it - a with-lse kernel
    (:data:`~.backends.LSE_KERNELS`), and one that takes a first key per row
    (:data:`~.backends.ROW_KEY_BOUNDS`) where a window cuts a node - else ``None``."""
    if backend not in LSE_KERNELS:
        return None
    layout = source_layout(plan, stored_rows, rows, window)
    if layout is None or (backend not in ROW_KEY_BOUNDS
                          and any(part.first_key is not None for part in layout.parts)):
        return None
    return layout


@dataclasses.dataclass(frozen=True)
class KeyRows:
    """What one attention layer holds for a plan (rows of ``nheads_k`` heads each).

    Attributes:
        execution: as :func:`choose_execution` chose it.
        kv_rows: K (and as many V) rows the layer holds: the flat rows in place, plus the
            copies under ``"gather"``: the gathered keys and, with a stored prefix, its
            concatenation with the flat rows.
        computed_rows: rows the plan computes (``T_flat``).
        query_rows_copied: query rows copied for the node part (``"sources"``): a reader's
            tail once per node it reads.
        stored_rows: K/V rows of a cross-micro-batch store the layer reads (the plan's
            ``external_rows``; held across micro-batches by the store, not by this layer).
    """

    execution: str
    kv_rows: int
    computed_rows: int
    query_rows_copied: int
    stored_rows: int = 0


def key_rows(plan: SharingPlan, *, window: int | None = None, backend: str = "torch",
             execution: str = "auto") -> KeyRows:
    """K/V rows one layer holds for ``plan`` (flat K/V of the plan's rows given, and its
    external rows, if any, as one stored source), under ``execution`` (``"auto"``: the one
    :func:`choose_execution` chooses; ``"gather"``: what the gather would hold)."""
    stored = plan.external_rows
    stored_rows = (stored,) if stored else ()
    if execution == "auto":
        execution = choose_execution(plan, plan.num_tokens_flat, window, backend, stored_rows)
    computed = plan.num_tokens_flat
    if execution == "gather":
        keys = plan if window is None else windowed_keys(plan, window)
        concatenated = stored + computed if stored else 0
        return KeyRows(execution, computed + concatenated + keys.cu_seqlens_kv_host[-1],
                       computed, 0, stored)
    copied = 0
    if execution == "sources":
        copied = sum(part.cu_seqlens_q_host[-1] for part
                     in source_layout(plan, stored_rows, window=window).parts
                     if part.q_index is not None)
    return KeyRows(execution, computed, computed, copied, stored)


def source_layout(plan: SharingPlan, stored_rows: tuple[int, ...] = (),
                  rows: tuple[int, int] | None = None,
                  window: int | None = None) -> SourceLayout | None:
    """The plan's kernel calls and their merge (module docstring), with one dense part per
    stored source of ``stored_rows`` rows (they add up to ``plan.external_rows``), built on
    the host once per plan, stored rows, query rows and window and kept with it
    (:func:`~prefix_sharing.memo.derived`); ``None`` where the plan does not say where its
    prefix keys live (``prefix_runs_host``), or when it disagrees with the key segments (a
    plan rewritten around rows it does not lay out).

    ``rows``: only the query rows ``[lo, hi)`` of the flat layout (a context-parallel rank's
    slice, :mod:`prefix_sharing.megatron_ext.context_parallel`), over K/V of all the flat rows:
    each segment's local queries over its own rows up to its last local query (bottom-right
    causal), and the local rows of each node's readers over the node; the layout's q is the
    slice's rows. Not with stored sources (``None``).

    ``window``: a sliding window of this many keys. The own part takes it as its band; a
    node's (and a stored block's) readers keep the rows whose window reaches it, each with its
    first key there (:attr:`~.merge.KeyPart.first_key`; none where every kept row reads the
    whole node)."""
    return derived(plan, _build_layout, tuple(stored_rows), rows, window)


def _build_layout(plan: SharingPlan, stored_rows: tuple[int, ...],
                  rows: tuple[int, int] | None, window: int | None) -> SourceLayout | None:
    runs, bounds_q, bounds_kv = plan.prefix_runs_host, plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
    if runs is None or len(runs) != len(bounds_q) - 1 or sum(stored_rows) != plan.external_rows:
        return None
    if rows is not None and stored_rows:
        return None
    if window is not None and window < 1:
        raise ValueError(f"a sliding window holds at least one key (itself); got {window}")
    # the logical position of each segment's first query: its key range ends at its last query
    tails = [ke - ks - (qe - qs) for qs, qe, ks, ke
             in zip(bounds_q[:-1], bounds_q[1:], bounds_kv[:-1], bounds_kv[1:])]
    for i, segment in enumerate(runs):
        if plan.external_rows + sum(stop - start for start, stop in segment) != tails[i]:
            return None
    rows_total = plan.num_tokens_flat
    lo, hi = (0, rows_total) if rows is None else rows
    device = plan.cu_seqlens_q.device
    own = _own_part(plan, lo, hi, window) if rows is not None else KeyPart(
        None, plan.cu_seqlens_q, plan.cu_seqlens_q, bounds_q, bounds_q, plan.max_seqlen_q,
        plan.max_seqlen_q, causal=True, window=window)
    whole: list[KeyPart] = []
    reads: list[_Reads] = []
    offset = 0
    for i, n in enumerate(stored_rows):
        if window is None:  # every query row (pad rows too: their outputs are read by nobody)
            cu_all = (0, rows_total)
            whole.append(KeyPart(
                None, torch.tensor(cu_all, dtype=torch.int32, device=device),
                torch.tensor((0, n), dtype=torch.int32, device=device), cu_all, (0, n),
                rows_total, n, causal=False, source=i + 1))
        else:  # every segment reads block i at its rows' positions
            readers = [(segment, offset) for segment in range(len(runs))]
            reads.append(_Reads(i + 1, n, (((0, n), readers),)))
        offset += n
    # the node part: per node, its readers' (local) tail rows, segment order, over its rows
    reads.append(_Reads(0, rows_total, tuple(sorted(_node_readers(runs, offset).items()))))
    parts, read = [], []
    for part in reads:
        built = _read_part(part, bounds_q, tails, lo, hi, window, device)
        if built is not None:
            parts.append(built[0])
            read.append(built[1])
    if not parts:  # no (local) row reads a flat prefix: own segments and the stored blocks
        return SourceLayout((own, *whole))
    return SourceLayout((own, *whole, *parts), _slots(np.concatenate(read), hi - lo).to(device))


@dataclasses.dataclass(frozen=True)
class _Reads:
    """One source's key runs and their readers: ``nodes`` holds ``((start, stop), [(segment,
    position)])``, ``position`` the node's first key's logical position in that segment's
    sequence; the runs lie in order over the source's ``rows``."""

    source: int
    rows: int
    nodes: tuple[tuple[tuple[int, int], list[tuple[int, int]]], ...]


def _read_part(reads: _Reads, bounds_q: tuple[int, ...], tails: list[int], lo: int, hi: int,
               window: int | None, device: torch.device) -> tuple[KeyPart, np.ndarray] | None:
    """The dense part of ``reads`` (each node its readers' local rows over its keys, K/V in
    place: the rows between nodes are segments without queries) and its query rows; ``None``
    where no local row reads it. With a window a row at position ``p`` reads a node's keys
    from position ``p - window + 1`` on: rows reaching none of them are left out, the others
    carry their first key, and the node's keys start at the first one any of them reads."""
    q_rows, first, cu_q, cu_k = [], [], [0], [0]
    for (start, stop), readers in reads.nodes:
        rows, bounds = [], []
        for segment, position in readers:
            a, b = max(bounds_q[segment], lo), min(bounds_q[segment + 1], hi)
            if b <= a:
                continue
            local = np.arange(a, b)
            bound = np.zeros(b - a, dtype=np.int64)
            if window is not None:
                positions = tails[segment] + local - bounds_q[segment]
                bound = np.maximum(positions - window + 1 - position, 0)
                local, bound = local[bound < stop - start], bound[bound < stop - start]
            rows.append(local - lo)
            bounds.append(bound)
        count = sum(piece.size for piece in rows)
        if not count:
            continue
        # the node's keys from the first one a kept row reads (the rows before it join the
        # gap before the node, a segment without queries)
        skip = min(int(bound.min()) for bound in bounds if bound.size)
        q_rows += rows
        first += [bound - skip for bound in bounds]
        if start + skip > cu_k[-1]:
            cu_q.append(cu_q[-1])
            cu_k.append(start + skip)
        cu_q.append(cu_q[-1] + count)
        cu_k.append(stop)
    if cu_q[-1] == 0:
        return None
    if cu_k[-1] < reads.rows:
        cu_q.append(cu_q[-1])
        cu_k.append(reads.rows)
    read, bounds = np.concatenate(q_rows), np.concatenate(first)
    part = KeyPart(
        q_index=torch.from_numpy(read).to(device),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        cu_seqlens_q_host=tuple(cu_q),
        cu_seqlens_k_host=tuple(cu_k),
        max_seqlen_q=int(np.diff(cu_q).max()),
        max_seqlen_k=int(np.diff(cu_k).max()),
        causal=False,
        source=reads.source,
        first_key=torch.from_numpy(bounds).to(device) if bounds.any() else None,
    )
    return part, read


def _own_part(plan: SharingPlan, lo: int, hi: int, window: int | None) -> KeyPart:
    """The query rows ``[lo, hi)``, each segment's piece of them over the segment's rows up to
    its last local query (bottom-right causal), K/V in place: the flat rows outside those key
    ranges are segments without queries."""
    bounds_q = plan.cu_seqlens_q_host
    cu_q, cu_k = [0], [0]
    for qs, qe in zip(bounds_q[:-1], bounds_q[1:]):
        a, b = max(qs, lo), min(qe, hi)
        if b <= a:
            continue
        if qs > cu_k[-1]:
            cu_q.append(cu_q[-1])
            cu_k.append(qs)
        cu_q.append(cu_q[-1] + b - a)
        cu_k.append(b)
    if cu_k[-1] < plan.num_tokens_flat:
        cu_q.append(cu_q[-1])
        cu_k.append(plan.num_tokens_flat)
    device = plan.cu_seqlens_q.device
    return KeyPart(None, torch.tensor(cu_q, dtype=torch.int32, device=device),
                   torch.tensor(cu_k, dtype=torch.int32, device=device), tuple(cu_q),
                   tuple(cu_k), int(np.diff(cu_q).max()), int(np.diff(cu_k).max()),
                   causal=True, window=window)


def _node_readers(runs: tuple[tuple[tuple[int, int], ...], ...],
                  external_rows: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Shared nodes -> ``(segment, position)`` of the segments reading them, ``position`` the
    node's first key's logical position in the segment's sequence (after ``external_rows``
    stored rows). Every run is cut at every run boundary, so a node is read whole or not at
    all by each segment (a tree's edges)."""
    cuts = sorted({edge for segment in runs for run in segment for edge in run})
    readers: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, segment in enumerate(runs):
        position = external_rows
        for start, stop in segment:
            lo, hi = bisect.bisect_left(cuts, start), bisect.bisect_left(cuts, stop)
            for node in zip(cuts[lo:hi], cuts[lo + 1 : hi + 1]):
                readers.setdefault(node, []).append((i, position + node[0] - start))
            position += stop - start
    return readers


def _slots(rows: np.ndarray, rows_total: int) -> torch.Tensor:
    """``(T, D)``: for each flat row, the positions in ``rows`` that hold it (node order),
    padded with ``len(rows)``."""
    order = np.argsort(rows, kind="stable")
    counts = np.bincount(rows, minlength=rows_total)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(rows.size) - first[rows[order]]
    slots = np.full((rows_total, max(int(counts.max()), 1)), rows.size, dtype=np.int64)
    slots[rows[order], rank] = order
    return torch.from_numpy(slots)
