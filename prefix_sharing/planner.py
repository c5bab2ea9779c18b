"""Builds the :class:`~prefix_sharing.plan.SharingPlan` of a micro-batch from its token ids.

How sharing is found (``mode="arbitrary_prefix"``): sort the sequences lexicographically. The
longest prefix a sequence shares with *any* sequence before it in that order is its longest
common prefix (LCP) with its immediate predecessor, so one sort and one adjacent-LCP pass find
every shareable prefix of every length - chains, trees, duplicates and strict prefixes alike.
Each sequence then takes ``prefix_len`` tokens from its predecessor and owns a contiguous tail.

The sort key ends every sequence with a terminator larger than any token, so a sequence that is
a strict prefix of another sorts *after* it and owns no token at all (as does a duplicate).

With recorded routes (MoE routing replay: per token, the experts each layer sent it to), a
token's identity is its id *and* its routes: the same rules run on one dense id per distinct
(token, routes) pair, so a route mismatch ends a shared prefix exactly where a token mismatch
would. Rollout engines are not batch-invariant, so token-identical prefixes may carry different
routes; ``plan.route_divergent_prefix_tokens`` counts the tokens that costs. A vision-language
micro-batch's image tags (which image, which of its tokens) enter a token's identity the same
way (``images=``), so token-identical prompts over different images share only the text before
the first image token.

Everything here is numpy on the host: the plan depends on token ids (and routes) and the config
alone, is deterministic, and every rank that needs it builds the same one locally.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple, Union

import numpy as np
import torch

from .config import PrefixSharingConfig
from .plan import SharingPlan

__all__ = ["build_plan", "PromptGroup", "prompt_groups", "token_identity"]

TokenSequence = Union[torch.Tensor, np.ndarray, Sequence[int]]

# Token ids are compared as big-endian uint32 bytes; this terminator sorts after every id.
_MAX_TOKEN_ID = 2**31 - 1
_TERMINATOR = 2**32 - 1


class PromptGroup(NamedTuple):
    """Sequences (indices into the batch) that start with the same ``prompt_len`` tokens."""

    prompt_len: int
    members: Sequence[int]


def build_plan(
    sequences: Sequence[TokenSequence],
    config: PrefixSharingConfig | None = None,
    *,
    groups: Sequence[PromptGroup | tuple[int, Sequence[int]]] | None = None,
    pad_to_multiple_of: int = 1,
    routes: Sequence[TokenSequence] | None = None,
    images: Sequence[TokenSequence] | None = None,
) -> SharingPlan:
    """Plans one micro-batch: which tokens are computed, and which rows every token reads.

    Args:
        sequences: the micro-batch, one 1-D integer token-id sequence each (torch tensors on any
            device, numpy arrays or lists), unpadded, in the order the caller wants its outputs.
        config: what to share; ``PrefixSharingConfig()`` (arbitrary prefixes of >= 8 tokens)
            when omitted.
        groups: for ``mode="prompt_only"`` only: ``(prompt_len, members)`` pairs, e.g. one per
            verl ``uid``. Members must start with identical ``prompt_len`` tokens; the first
            member computes the prompt, the others reuse it. Sequences in no group share nothing.
        pad_to_multiple_of: pad the flat layout to a multiple of this many rows (tensor- or
            sequence-parallel size). Pad rows form their own causal segment, so they never
            change a real token's result.
        routes: recorded MoE routes (routing replay), ``(L_i, ...)`` integers per sequence: a
            token's routes are part of its identity.
        images: a vision-language micro-batch's placeholder tags, ``(L_i, k)`` integers per
            sequence (:func:`prefix_sharing.fsdp_compat.vision.vision_batch`: which image and
            which of its tokens, 0 for text): part of a token's identity the same way, so a
            prefix is shared only where the images behind it agree too.

    Returns:
        The :class:`SharingPlan`, its tensors on the CPU (``plan.to(device)`` moves them).
    """
    config = PrefixSharingConfig() if config is None else config
    if not isinstance(config, PrefixSharingConfig):
        raise TypeError(f"config must be a PrefixSharingConfig; got {type(config).__name__}")
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or (
        pad_to_multiple_of < 1
    ):
        raise ValueError(f"pad_to_multiple_of must be an integer >= 1; got {pad_to_multiple_of!r}")

    tokens, lengths = _as_token_array(sequences)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    if groups is not None and config.mode != "prompt_only":
        raise ValueError(f"groups= is only used by mode='prompt_only'; mode is {config.mode!r}")
    if config.mode == "prompt_only" and groups is None:
        raise ValueError("mode='prompt_only' needs groups=[(prompt_len, members), ...]")
    tagged = tokens if images is None else _tagged_identity(tokens, lengths, images, "images")
    if routes is None:
        prefix_lens, sources, order = _sharing(tokens, tagged, offsets, config, groups)
        return _layout(tokens, offsets, prefix_lens, sources, order, pad_to_multiple_of)
    identity = _tagged_identity(tagged, lengths, routes, "routes")
    prefix_lens, sources, order = _sharing(tokens, identity, offsets, config, groups)
    by_tokens = _sharing(tokens, tagged, offsets, config, groups)[0]
    return _layout(tokens, offsets, prefix_lens, sources, order, pad_to_multiple_of,
                   route_divergent=int(by_tokens.sum() - prefix_lens.sum()))


def prompt_groups(uids: Sequence[object], prompt_lens: Sequence[int]) -> list[PromptGroup]:
    """Groups a batch by verl-style ``uid``: one :class:`PromptGroup` per distinct uid.

    Members of a uid must have the same prompt length (they were sampled from one prompt).
    """
    if len(uids) != len(prompt_lens):
        raise ValueError(f"{len(uids)} uids but {len(prompt_lens)} prompt lengths")
    members: dict[object, list[int]] = {}
    for i, uid in enumerate(uids):
        members.setdefault(uid, []).append(i)
    out = []
    for uid, idx in members.items():
        lens = {int(prompt_lens[i]) for i in idx}
        if len(lens) != 1:
            raise ValueError(f"uid {uid!r} has members with different prompt lengths {sorted(lens)}")
        out.append(PromptGroup(lens.pop(), idx))
    return out


def token_identity(sequences: Sequence[TokenSequence],
                   routes: Sequence[TokenSequence]) -> list[torch.Tensor]:
    """One int64 id per token of every sequence: the same id exactly where the token and its
    recorded routes (``(L_i, ...)`` per sequence, as :func:`build_plan` takes them) are the
    same, ordered as the tokens where the routes agree. What :func:`build_plan` compares with
    ``routes``, for a caller that cuts sequences by it (a group across micro-batches:
    :func:`prefix_sharing.cross_micro_batch.plan_group`)."""
    tokens, lengths = _as_token_array(sequences)
    identity = torch.from_numpy(_tagged_identity(tokens, lengths, routes, "routes"))
    return list(identity.split(lengths.tolist()))


# --------------------------------------------------------------------------- input checking
def _as_token_array(sequences: Sequence[TokenSequence]) -> tuple[np.ndarray, np.ndarray]:
    """Validates the batch; returns all tokens concatenated (int64) and the lengths."""
    if isinstance(sequences, (torch.Tensor, np.ndarray)):
        raise TypeError(
            f"sequences must be a list of 1-D token-id sequences; got a {sequences.ndim}-D "
            f"{type(sequences).__name__} (unpad it into a list, e.g. [row[mask] for ...])"
        )
    if len(sequences) == 0:
        raise ValueError("build_plan needs at least one sequence; got an empty batch")
    parts = [_as_tensor(i, s) for i, s in enumerate(sequences)]
    for i, part in enumerate(parts):
        if part.dim() != 1:
            raise ValueError(f"sequence {i} must be 1-D token ids; got shape {tuple(part.shape)}")
        if part.numel() == 0:
            raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
        if part.dtype == torch.bool or part.is_floating_point() or part.is_complex():
            raise ValueError(f"sequence {i} has non-integer token ids (dtype {part.dtype})")
    # One device-to-host copy for the whole batch, whatever device the ids live on.
    tokens = torch.cat(parts).to("cpu", torch.int64)
    low, high = torch.aminmax(tokens)
    if low < 0 or high > _MAX_TOKEN_ID:
        bad = int(low) if low < 0 else int(high)
        raise ValueError(f"token ids must lie in [0, {_MAX_TOKEN_ID}]; found {bad}")
    lengths = np.fromiter((p.numel() for p in parts), dtype=np.int64, count=len(parts))
    return tokens.numpy(), lengths


def _as_tensor(i: int, seq: TokenSequence) -> torch.Tensor:
    if isinstance(seq, torch.Tensor):
        return seq
    try:
        arr = np.asarray(seq)
    except ValueError:  # ragged nesting
        arr = np.empty(0, dtype=object)
    if arr.dtype.kind not in "biuf":  # ragged lists and strings become object/str arrays
        raise ValueError(f"sequence {i} is not a flat list of integer token ids")
    return torch.from_numpy(arr)


def _tagged_identity(tokens: np.ndarray, lengths: np.ndarray,
                     routes: Sequence[TokenSequence], name: str) -> np.ndarray:
    """One dense id per distinct (token, tags) pair, ordered like the tokens; ``routes`` are
    the tags (recorded routes, or image tags), ``name`` names them in errors.

    ``np.unique`` over rows ``[token, tags...]`` sorts them lexicographically, so where the
    tags agree the ids sort exactly as the tokens do, and the planner finds the same plan.
    """
    if isinstance(routes, (torch.Tensor, np.ndarray)) or len(routes) != lengths.size:
        got = f"{len(routes)} arrays" if not isinstance(routes, (torch.Tensor, np.ndarray)) else (
            f"a {type(routes).__name__}")
        raise ValueError(f"{name} must be one array per sequence ({lengths.size}); got {got}")
    parts = [torch.as_tensor(np.asarray(r)) if not isinstance(r, torch.Tensor) else r
             for r in routes]
    shape = tuple(parts[0].shape[1:])
    for i, (part, n) in enumerate(zip(parts, lengths.tolist())):
        if part.dim() == 0 or part.size(0) != n or tuple(part.shape[1:]) != shape:
            raise ValueError(
                f"{name} of sequence {i} have shape {tuple(part.shape)}; expected ({n}, *{shape}) "
                "(one row per token, the same trailing shape for every sequence)")
        if part.dtype == torch.bool or part.is_floating_point() or part.is_complex():
            raise ValueError(f"{name} of sequence {i} are not integer ids (dtype {part.dtype})")
    flat = torch.cat(parts).to("cpu", torch.int64).reshape(tokens.size, -1).numpy()
    rows = np.concatenate([tokens[:, None], flat], axis=1)
    return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int64)


# --------------------------------------------------------------------------- sharing rules
# Each rule returns (prefix_lens, sources, order): sequence r takes its first prefix_lens[r]
# tokens from sequence sources[r]; `order` lists the sequences so that every source comes
# before the sequences that read from it. The rules compare `identity` (the token ids, or one id
# per (token, routes) pair); prompt groups are checked on the tokens themselves.
Sharing = tuple[np.ndarray, np.ndarray, np.ndarray]


def _sharing(tokens: np.ndarray, identity: np.ndarray, offsets: np.ndarray,
             config: PrefixSharingConfig,
             groups: Sequence[PromptGroup | tuple[int, Sequence[int]]] | None) -> Sharing:
    if config.mode == "off":
        return _no_sharing(len(offsets) - 1)
    if config.mode == "prompt_only":
        return _prompt_sharing(tokens, identity, offsets, groups, config)
    return _prefix_sharing(identity, offsets, config)


def _no_sharing(n: int) -> Sharing:
    return np.zeros(n, dtype=np.int64), np.arange(n), np.arange(n)


def _prefix_sharing(tokens: np.ndarray, offsets: np.ndarray, config: PrefixSharingConfig) -> Sharing:
    prefix_lens, sources, order = _no_sharing(len(offsets) - 1)
    candidates = _candidates(tokens, offsets, config)
    if candidates.size < config.min_group_size:
        return prefix_lens, sources, order

    keys = [_sort_key(tokens[offsets[r] : offsets[r + 1]]) for r in candidates]
    ranked = candidates[sorted(range(candidates.size), key=keys.__getitem__)]
    lcp = np.zeros(ranked.size, dtype=np.int64)
    for i in range(1, ranked.size):
        lcp[i] = _common_prefix_len(tokens, offsets, ranked[i - 1], ranked[i])
    shared = _enforce_group_size(lcp, config.min_group_size)
    shared[shared < config.min_prefix_len] = 0

    prefix_lens[ranked] = shared
    sources[ranked[1:]] = ranked[:-1]
    order = np.concatenate([np.setdiff1d(order, ranked, assume_unique=True), ranked])
    return prefix_lens, sources, order


def _sort_key(ids: np.ndarray) -> bytes:
    """Bytes that sort like the token sequence, strict prefixes after their extensions."""
    key = np.empty(ids.size + 1, dtype=">u4")
    key[:-1] = ids
    key[-1] = _TERMINATOR
    return key.tobytes()


def _candidates(tokens: np.ndarray, offsets: np.ndarray, config: PrefixSharingConfig) -> np.ndarray:
    """Sequences whose first ``min_prefix_len`` tokens occur in >= ``min_group_size`` sequences.

    No other sequence can share anything, and in a batch without sharing this cheap check
    (one short bytes key per sequence) is the only work done.
    """
    head = config.min_prefix_len
    starts = offsets[:-1]
    long_enough = np.flatnonzero(np.diff(offsets) >= head)
    heads = [tokens[starts[r] : starts[r] + head].tobytes() for r in long_enough]
    counts = Counter(heads)
    keep = np.fromiter((counts[h] >= config.min_group_size for h in heads), bool, len(heads))
    return long_enough[keep]


def _common_prefix_len(tokens: np.ndarray, offsets: np.ndarray, a: int, b: int,
                       limit: int | None = None) -> int:
    m = min(offsets[a + 1] - offsets[a], offsets[b + 1] - offsets[b])
    m = m if limit is None else min(m, limit)
    differ = tokens[offsets[a] : offsets[a] + m] != tokens[offsets[b] : offsets[b] + m]
    first = int(differ.argmax())  # argmax stops at the first True
    return first if differ[first] else int(m)


def _enforce_group_size(lcp: np.ndarray, group_size: int) -> np.ndarray:
    """Shortens each adjacent LCP to the longest prefix held by >= ``group_size`` sequences.

    In sorted order, the sequences holding a prefix of length ``L`` form a run whose adjacent
    LCPs are all >= ``L``. So a window of ``group_size`` consecutive sequences shares
    ``min(lcp over the window)`` tokens, and sequence ``i`` may share the largest such value over
    the windows that contain it (never more than its own LCP with its predecessor).
    """
    n = lcp.size
    if group_size <= 2:
        return lcp.copy()
    if n < group_size:
        return np.zeros_like(lcp)
    window = np.lib.stride_tricks.sliding_window_view
    shared_by_window = window(lcp[1:], group_size - 1).min(axis=1)  # window start a: a..a+g-1
    padded = np.pad(shared_by_window, group_size - 1)
    best = window(padded, group_size).max(axis=1)  # over the g windows containing i
    return np.minimum(lcp, best)


def _prompt_sharing(
    tokens: np.ndarray,
    identity: np.ndarray,
    offsets: np.ndarray,
    groups: Sequence[PromptGroup | tuple[int, Sequence[int]]],
    config: PrefixSharingConfig,
) -> Sharing:
    n = len(offsets) - 1
    prefix_lens, sources, _ = _no_sharing(n)
    readers = []
    owner = np.full(n, -1, dtype=np.int64)
    for g, group in enumerate(groups):
        prompt_len, members = _check_group(g, group, n)
        for m in members:
            if owner[m] >= 0:
                raise ValueError(f"groups {owner[m]} and {g} both contain sequence {m}")
            owner[m] = g
            if offsets[m + 1] - offsets[m] < prompt_len:
                raise ValueError(
                    f"group {g}: sequence {m} has {offsets[m + 1] - offsets[m]} tokens, "
                    f"fewer than the group's prompt_len {prompt_len}"
                )
        first = members[0]
        prompt = tokens[offsets[first] : offsets[first] + prompt_len]
        for m in members[1:]:
            if not np.array_equal(tokens[offsets[m] : offsets[m] + prompt_len], prompt):
                raise ValueError(
                    f"group {g}: sequence {m} does not start with the same {prompt_len} prompt "
                    f"tokens as sequence {first}"
                )
        if len(members) >= config.min_group_size and prompt_len >= config.min_prefix_len:
            for m in members[1:]:  # the prompt, up to where the routes (if any) diverge
                shared = _common_prefix_len(identity, offsets, first, m, limit=prompt_len)
                if shared >= config.min_prefix_len:
                    prefix_lens[m], sources[m] = shared, first
                    readers.append(m)
    readers = np.asarray(readers, dtype=np.int64)
    order = np.concatenate([np.setdiff1d(np.arange(n), readers), readers])
    return prefix_lens, sources, order


def _check_group(g: int, group: object, n: int) -> tuple[int, list[int]]:
    try:
        prompt_len, members = group  # type: ignore[misc]
        members = [int(m) for m in members]
    except (TypeError, ValueError):
        raise ValueError(f"group {g} must be a (prompt_len, members) pair; got {group!r}") from None
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or prompt_len < 0:
        raise ValueError(f"group {g}: prompt_len must be an integer >= 0; got {prompt_len!r}")
    if not members:
        raise ValueError(f"group {g} has no members")
    if len(set(members)) != len(members):
        raise ValueError(f"group {g} lists a member twice: {members}")
    bad = [m for m in members if not 0 <= m < n]
    if bad:
        raise ValueError(f"group {g}: member index {bad[0]} is outside the batch of {n} sequences")
    return int(prompt_len), members


# --------------------------------------------------------------------------- flat layout
def _layout(
    tokens: np.ndarray,
    offsets: np.ndarray,
    prefix_lens: np.ndarray,
    sources: np.ndarray,
    order: np.ndarray,
    pad_to_multiple_of: int,
    route_divergent: int = 0,
) -> SharingPlan:
    """Lays out the owned tails contiguously (given order) and resolves every token's row."""
    lengths = np.diff(offsets)
    own = lengths - prefix_lens
    owners = np.flatnonzero(own)
    n_unique = int(own.sum())
    ramp = np.arange(lengths.max(), dtype=np.int64)

    if n_unique == tokens.size:  # nothing shared: the plain packed (THD) layout
        kv_index = np.arange(tokens.size, dtype=np.int64)
        input_ids, kv_gather = tokens, kv_index
        position_ids = np.concatenate([ramp[:n] for n in lengths])
    else:
        # Owned tails take consecutive flat rows; a reused prefix copies its source's rows,
        # sources first (``order``), so a chain of reuse resolves to the computing rows.
        kv_index = np.empty(tokens.size, dtype=np.int64)
        row = 0
        for r in owners:
            np.add(ramp[: own[r]], row, out=kv_index[offsets[r] + prefix_lens[r] : offsets[r + 1]])
            row += own[r]
        for r in order[prefix_lens[order] > 0]:
            p, s = prefix_lens[r], sources[r]
            kv_index[offsets[r] : offsets[r] + p] = kv_index[offsets[s] : offsets[s] + p]
        input_ids = np.concatenate([tokens[offsets[r] + prefix_lens[r] : offsets[r + 1]] for r in owners])
        position_ids = np.concatenate([ramp[prefix_lens[r] : lengths[r]] for r in owners])
        if owners.size == lengths.size:  # every sequence has a segment: same rows, same order
            kv_gather = kv_index
        else:
            kv_gather = np.concatenate([kv_index[offsets[r] : offsets[r + 1]] for r in owners])

    q_lens, kv_lens = own[owners], lengths[owners]
    runs = [_runs(kv_index[offsets[r] : offsets[r] + prefix_lens[r]]) for r in owners]
    num_padding = -n_unique % pad_to_multiple_of
    if num_padding:
        pad_rows = np.arange(n_unique, n_unique + num_padding, dtype=np.int64)
        input_ids = np.concatenate([input_ids, np.zeros(num_padding, dtype=np.int64)])
        position_ids = np.concatenate([position_ids, pad_rows - n_unique])
        kv_gather = np.concatenate([kv_gather, pad_rows])
        q_lens = np.append(q_lens, num_padding)
        kv_lens = np.append(kv_lens, num_padding)
        runs.append(())

    cu_q, cu_kv = _cumsum_int32(q_lens), _cumsum_int32(kv_lens)
    return SharingPlan(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens_q=torch.from_numpy(cu_q),
        cu_seqlens_kv=torch.from_numpy(cu_kv),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_kv=int(kv_lens.max()),
        cu_seqlens_q_host=tuple(cu_q.tolist()),
        cu_seqlens_kv_host=tuple(cu_kv.tolist()),
        kv_gather_index=torch.from_numpy(kv_gather),
        kv_index=torch.from_numpy(kv_index),
        seq_lens=tuple(lengths.tolist()),
        prefix_lens=tuple(prefix_lens.tolist()),
        prefix_runs_host=tuple(runs),
        num_padding=num_padding,
        route_divergent_prefix_tokens=route_divergent,
    )


def _runs(rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    """``rows`` (a prefix's flat rows, in logical order) as maximal runs ``(start, stop)`` of
    consecutive rows."""
    if rows.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate([[0], breaks])]
    stops = rows[np.concatenate([breaks - 1, [rows.size - 1]])] + 1
    return tuple(zip(starts.tolist(), stops.tolist()))


def _cumsum_int32(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out
