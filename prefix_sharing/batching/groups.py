"""Sharing groups: the samples whose prefixes are shared, which batching keeps together.

A prefix is computed once only when its sharers sit in the same micro-batch (and so on the
same data-parallel rank). The unit every split here moves is therefore a *sharing group*: the
samples of one ``uid`` when uids are given, else the sequences the planner links by a shared
prefix (the connected components of ``build_plan`` on the whole batch).

Cutting a group, when it must be cut, is done in lexicographic token order, where every
sub-tree is a contiguous run and the common-prefix length of two neighbours says how deep
they part (:func:`lexicographic_order`): cutting where neighbours part earliest keeps the
deepest shared prefixes whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from ..config import PrefixSharingConfig
from ..planner import TokenSequence, build_plan

__all__ = ["connected_components", "lexicographic_order", "sharing_groups"]


def sharing_groups(sequences: Sequence[TokenSequence], config: PrefixSharingConfig,
                   uids: Sequence[Hashable] | None = None) -> list[list[int]]:
    """The split's unit of packing: sharing groups, each a list of batch indices in batch
    order, groups ordered by first member (the samples of one uid when ``uids`` are given, else
    the sequences the planner links by shared prefixes; every sample alone with ``mode="off"``)."""
    n = len(sequences)
    if config.mode == "off":
        return [[i] for i in range(n)]
    if uids is not None:
        members: dict[Hashable, list[int]] = {}
        for i, uid in enumerate(uids):
            members.setdefault(uid, []).append(i)
        return list(members.values())
    # The planner on the whole batch: a sequence that reuses a prefix reads it from rows that
    # another sequence computes; linking each reader to the owner of its last prefix row
    # joins every chain and tree into one component.
    plan = build_plan(list(sequences), config)
    lengths = np.asarray(plan.seq_lens)
    prefix = np.asarray(plan.prefix_lens)
    owners = np.flatnonzero(lengths > prefix)
    row_owner = np.repeat(owners, (lengths - prefix)[owners])
    starts = plan.cu_seqlens[:-1].numpy()
    readers = np.flatnonzero(prefix)
    last_prefix_rows = plan.kv_index.numpy()[starts[readers] + prefix[readers] - 1]
    return connected_components(n, zip(readers.tolist(), row_owner[last_prefix_rows].tolist()))


def connected_components(n: int, links: Iterable[tuple[int, int]]) -> list[list[int]]:
    """The components of ``n`` nodes under undirected ``links`` (union-find), each a list of
    nodes in ascending order, components ordered by their first node."""
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in links:
        ra, rb = root(a), root(b)
        parent[max(ra, rb)] = min(ra, rb)
    components: dict[int, list[int]] = {}
    for i in range(n):
        components.setdefault(root(i), []).append(i)
    return list(components.values())


def lexicographic_order(members: Sequence[int],
                        sequences: Sequence[TokenSequence]) -> tuple[list[int], list[int]]:
    """``members`` in lexicographic token order (ties by index), and ``parting[k]``: the
    common-prefix length of ``ordered[k - 1]`` and ``ordered[k]`` (0 for ``k = 0``) - how deep
    a cut before position ``k`` goes into what the two share."""
    rows = {i: np.asarray(sequences[i]).astype(np.int64) for i in members}
    ordered = sorted(members, key=lambda i: (rows[i].astype(">u4").tobytes(), i))
    parting = [0] + [_common_prefix_len(rows[a], rows[b]) for a, b in zip(ordered, ordered[1:])]
    return ordered, parting


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m
