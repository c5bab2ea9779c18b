"""A sliding window's view of a plan: each segment's gathered keys trimmed to what it can see.

A query at logical position ``p`` with a window of ``w`` keys reads positions ``p - w + 1 .. p``.
A segment's queries are its last ``s`` positions of ``L``, so the first query (``L - s``) reaches
back to ``L - s - w + 1``: the ``t = max(0, L - s - w + 1)`` keys before that are read by no
query of the segment. Dropping them from the gather saves their bytes and their (masked) FLOPs,
and leaves the band unchanged, since the band is aligned to the segment's last key.

Worked example, the plan of :class:`~prefix_sharing.plan.SharingPlan` (``b = [5 6 7 9 9]``
reuses ``a``'s first three tokens) with ``w = 2``: ``b``'s tail starts at position 3 and reads
back to position 2, so keys 0 and 1 are trimmed::

    plan.kv_gather_index = [0 1 2 3 | 0 1 2 4 5]    cu_seqlens_kv = [0 4 9]
    w = 2:                 [0 1 2 3 | 2 4 5]        cu_seqlens_kv = [0 4 7]

``a`` keeps all its keys: its first query is position 0 (a segment that computes its whole
sequence is never trimmed).
"""

from __future__ import annotations

import dataclasses

import torch

from ..memo import derived
from ..plan import SharingPlan

__all__ = ["WindowedKeys", "windowed_keys"]


@dataclasses.dataclass(frozen=True)
class WindowedKeys:
    """The key segments a window needs (same meaning as the plan's fields of these names)."""

    kv_gather_index: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_kv_host: tuple[int, ...]
    max_seqlen_kv: int


def windowed_keys(plan: SharingPlan, window: int) -> WindowedKeys:
    """The plan's key segments trimmed to the last keys ``window`` lets its queries see.

    Computed on the host from the plan's host boundaries once per (plan, window) and kept
    with the plan (:func:`~prefix_sharing.memo.derived`): every layer with the same window
    reuses it, no layer reads the device. When no segment loses a key, the plan's own tensors
    are returned.
    """
    if window < 1:
        raise ValueError(f"a sliding window holds at least one key (itself); got {window}")
    return derived(plan, _trim, window)


def _trim(plan: SharingPlan, window: int) -> WindowedKeys:
    bounds_q, bounds_kv = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
    starts, lens = [], []
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_kv[:-1], bounds_kv[1:]):
        s, L = qe - qs, ke - ks
        t = max(0, L - s - window + 1)  # keys before the first query's band
        starts.append(ks + t)
        lens.append(L - t)
    if sum(lens) == bounds_kv[-1]:
        return WindowedKeys(plan.kv_gather_index, plan.cu_seqlens_kv, bounds_kv,
                            plan.max_seqlen_kv)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    # positions in kv_gather_index to keep: segment i's rows starts[i] .. starts[i] + lens[i]
    lengths = torch.tensor(lens)
    offsets = torch.tensor(starts) - torch.tensor(cu[:-1])
    keep = torch.arange(cu[-1]) + offsets.repeat_interleave(lengths)
    device = plan.kv_gather_index.device
    return WindowedKeys(
        kv_gather_index=plan.kv_gather_index.index_select(0, keep.to(device)),
        cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32, device=device),
        cu_seqlens_kv_host=tuple(cu),
        max_seqlen_kv=max(lens),
    )
