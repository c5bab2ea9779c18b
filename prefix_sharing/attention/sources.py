"""How a plan's attention runs, chosen once per plan on the host, and its key-source layout.

Three executions compute the same attention (every computed token over all earlier tokens of
its own sequence):

- ``"in_place"``: no segment reads a prefix (the identity plan; chains of strict prefixes):
  one varlen call over K/V as they are.
- ``"sources"``: every query row attends to its own segment's rows causally (one call) and to
  each *shared node* it reads - a run of flat rows that a set of segments all read as prefix -
  with no mask, since a node lies wholly before each reader's tail (one call over all nodes:
  the dense rectangle of each node's readers over its keys). Both calls read K/V in place (the
  rows between nodes are segments without queries), and the partial results merge exactly by
  their log-sum-exp (:mod:`.merge`). K/V held per layer: the computed rows, ``T_flat``.
- ``"gather"``: each segment's keys copied together (``index_select`` through
  ``kv_gather_index``): K/V held per layer is every sequence's full key range that owns a
  tail, the total token count when every sequence owns one.

The rule (:func:`choose_execution`), in order:

1. K/V hold other rows than the plan's flat rows (a cross-micro-batch prefix stored in
   front): ``"gather"`` - the stored prefix is not a key source yet.
2. No segment reads a prefix: ``"in_place"``.
3. A sliding window: ``"gather"`` (trimmed to the window, :mod:`.window`) - a window cuts a
   shared node at a band that depends on each reader's own position, and the rectangle's
   kernels take no per-row band.
4. The backend has no with-lse kernel (:data:`~.backends.LSE_KERNELS`), or the plan no
   ``prefix_runs_host``: ``"gather"``.
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
from .backends import LSE_KERNELS
from .merge import KeyPart, SourceLayout
from .window import windowed_keys

__all__ = [
    "EXECUTIONS",
    "KeyRows",
    "choose_execution",
    "key_rows",
    "source_layout",
]

EXECUTIONS = ("in_place", "sources", "gather")


def choose_execution(plan: SharingPlan, key_rows_given: int, window: int | None,
                     backend: str) -> str:
    """The execution of the rule above for ``plan`` with K/V of ``key_rows_given`` rows, a
    ``window`` (or ``None``) and a concrete ``backend``. Host ints only."""
    if key_rows_given != plan.num_tokens_flat:
        return "gather"
    if not plan.has_kv_gather:
        return "in_place"
    if window is not None or backend not in LSE_KERNELS or source_layout(plan) is None:
        return "gather"
    return "sources"


@dataclasses.dataclass(frozen=True)
class KeyRows:
    """What one attention layer holds for a plan (rows of ``nheads_k`` heads each).

    Attributes:
        execution: as :func:`choose_execution` chose it.
        kv_rows: K (and as many V) rows the layer holds: the flat rows in place, plus the
            gathered copies under ``"gather"``.
        computed_rows: rows the plan computes (``T_flat``).
        query_rows_copied: query rows copied for the node part (``"sources"``): a reader's
            tail once per node it reads.
    """

    execution: str
    kv_rows: int
    computed_rows: int
    query_rows_copied: int


def key_rows(plan: SharingPlan, *, window: int | None = None, backend: str = "torch") -> KeyRows:
    """K/V rows one layer holds for ``plan`` (flat K/V of the plan's rows given)."""
    execution = choose_execution(plan, plan.num_tokens_flat, window, backend)
    computed = plan.num_tokens_flat
    if execution == "gather":
        keys = plan if window is None else windowed_keys(plan, window)
        return KeyRows(execution, computed + keys.cu_seqlens_kv_host[-1], computed, 0)
    copied = 0
    if execution == "sources":
        copied = source_layout(plan).parts[1].cu_seqlens_q_host[-1]
    return KeyRows(execution, computed, computed, copied)


def source_layout(plan: SharingPlan) -> SourceLayout | None:
    """The plan's two kernel calls and their merge (module docstring), built on the host once
    per plan and kept with it (:func:`~prefix_sharing.memo.derived`); ``None`` where the plan
    does not say where its prefix keys live (``prefix_runs_host``), or when it disagrees with
    the key segments (a plan rewritten around rows it does not lay out)."""
    return derived(plan, _build_layout)


def _build_layout(plan: SharingPlan) -> SourceLayout | None:
    runs, bounds_q, bounds_kv = plan.prefix_runs_host, plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
    if runs is None or len(runs) != len(bounds_q) - 1:
        return None
    for i, segment in enumerate(runs):
        prefix = sum(stop - start for start, stop in segment)
        if prefix + bounds_q[i + 1] - bounds_q[i] != bounds_kv[i + 1] - bounds_kv[i]:
            return None
    readers = _node_readers(runs)
    rows_total = plan.num_tokens_flat
    device = plan.cu_seqlens_q.device
    own = KeyPart(None, plan.cu_seqlens_q, plan.cu_seqlens_q, bounds_q, bounds_q,
                  plan.max_seqlen_q, plan.max_seqlen_q, causal=True)
    if not readers:  # no segment reads a prefix: its own segments are everything
        return SourceLayout((own,))

    # the node part: per node, its readers' tails (segment order) over its rows; the rows
    # between nodes are segments without queries, so K/V stay in place
    q_rows, cu_q, cu_k = [], [0], [0]
    for (start, stop), segments in sorted(readers.items()):
        if start > cu_k[-1]:
            cu_q.append(cu_q[-1])
            cu_k.append(start)
        q_rows.extend(np.arange(bounds_q[i], bounds_q[i + 1]) for i in segments)
        cu_q.append(cu_q[-1] + sum(bounds_q[i + 1] - bounds_q[i] for i in segments))
        cu_k.append(stop)
    if cu_k[-1] < rows_total:
        cu_q.append(cu_q[-1])
        cu_k.append(rows_total)
    rows = np.concatenate(q_rows)
    nodes = KeyPart(
        q_index=torch.from_numpy(rows).to(device),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
        cu_seqlens_q_host=tuple(cu_q),
        cu_seqlens_k_host=tuple(cu_k),
        max_seqlen_q=int(np.diff(cu_q).max()),
        max_seqlen_k=int(np.diff(cu_k).max()),
        causal=False,
    )
    return SourceLayout((own, nodes), _slots(rows, rows_total).to(device))


def _node_readers(runs: tuple[tuple[tuple[int, int], ...], ...]) -> dict[tuple[int, int], list[int]]:
    """Shared nodes -> the segments reading them. Every run is cut at every run boundary,
    so a node is read whole or not at all by each segment (a tree's edges)."""
    cuts = sorted({edge for segment in runs for run in segment for edge in run})
    readers: dict[tuple[int, int], list[int]] = {}
    for i, segment in enumerate(runs):
        for start, stop in segment:
            lo, hi = bisect.bisect_left(cuts, start), bisect.bisect_left(cuts, stop)
            for node in zip(cuts[lo:hi], cuts[lo + 1 : hi + 1]):
                readers.setdefault(node, []).append(i)
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
