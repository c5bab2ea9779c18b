"""Planning one group that is too large for one micro-batch: its prefix once, its tails in pieces.

A group (sequences sharing one long common prefix ``P``) whose computed tokens exceed the
micro-batch token budget is cut into a *prefix micro-batch* (``P`` alone, computed once) and
*suffix micro-batches* (each a set of the sequences' tails after ``P``, at most ``token_budget``
computed tokens). One level: the group's single longest common prefix is shared across
micro-batches; sharing deeper in the tree (a mid-level branch) happens inside a suffix
micro-batch, through its own plan, and a branch cut between two suffix micro-batches is
computed once in each (``tokens_computed`` then exceeds the whole batch's ``tokens_unique``).

A suffix micro-batch's :class:`~prefix_sharing.plan.SharingPlan` addresses *external prefix
rows plus its own rows*: its K/V rows ``0 .. Lp-1`` are the prefix micro-batch's (read from the
layers' kept K/V), rows ``Lp ..`` its own flat layout. Worked example, the group
``a = [5 6 7 8 9]``, ``b = [5 6 7 8 4]``, ``c = [5 6 7 2]`` (``P = [5 6 7]``, Lp = 3) in one
suffix micro-batch, every prefix shared (``b``'s tail ``[8 4]`` provides the ``8`` that ``a``'s
tail reuses)::

    input_ids       = [9 | 8 4 | 2]        own rows only (T_flat = 4)
    position_ids    = [4 | 3 4 | 3]        absolute positions (the tails start at Lp)
    cu_seqlens_q    = [0 1 3 4]
    cu_seqlens_kv   = [0 5 10 14]          each segment's keys: Lp prefix rows + its tail's
    kv_gather_index = [0 1 2 4 3 | 0 1 2 4 5 | 0 1 2 6]   into cat(prefix K/V, own K/V)
    kv_index        = the same here (every token of a, b, c, same addressing)
    prefix_lens     = (4, 3, 3)

Its log-probs and entropy come from ``tail_plan`` (the tails' own plan on the same flat rows);
the prefix positions ``0 .. Lp-1`` of every sequence are scored in the prefix micro-batch
(``prefix_stats_plan``), where the last prefix row predicts each sequence's first own token.

Pure torch/numpy; the driver that runs the micro-batches is
:mod:`prefix_sharing.megatron_ext.cross_micro_batch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .config import PrefixSharingConfig
from .plan import SharingPlan
from .planner import TokenSequence, build_plan

__all__ = ["SuffixMicroBatch", "GroupSchedule", "common_prefix_len", "plan_group"]


@dataclasses.dataclass(frozen=True)
class SuffixMicroBatch:
    """One suffix micro-batch of a group.

    Attributes:
        members: indices (into the group's sequences) of the sequences whose tails it computes.
        plan: the model's plan (K/V rows = ``prefix_len`` external rows, then its own rows).
        tail_plan: the tails' own plan over the same flat rows, for log-probs and entropy.
        token_positions: ``(sum of tail lengths,)`` int64, where each tail token sits in the
            group's packed order (sequences in given order): where its log-prob belongs.
    """

    members: tuple[int, ...]
    plan: SharingPlan
    tail_plan: SharingPlan
    token_positions: torch.Tensor


@dataclasses.dataclass(frozen=True)
class GroupSchedule:
    """A group as a prefix micro-batch and suffix micro-batches (one shared level).

    Attributes:
        prefix_ids: ``(prefix_len,)`` the common prefix, computed once.
        prefix_stats_plan: a plan over ``prefix_len + N`` rows (the prefix's rows, then one
            placeholder row per sequence) whose sequences are ``s_i[:prefix_len + 1]``: with the
            prefix's logits (and any placeholder rows) it gives every sequence's log-probs and
            entropy at positions ``0 .. prefix_len - 1``; position ``prefix_len`` is discarded.
        prefix_positions: ``(N * prefix_len,)`` int64, those positions in the group's packed order.
        suffixes: the suffix micro-batches, in run order.
        seq_lens: every sequence's length (given order).
        tokens_unique: tokens the whole group's single plan computes (``build_plan``).
    """

    prefix_ids: torch.Tensor
    prefix_stats_plan: SharingPlan
    prefix_positions: torch.Tensor
    suffixes: tuple[SuffixMicroBatch, ...]
    seq_lens: tuple[int, ...]
    tokens_unique: int

    @property
    def prefix_len(self) -> int:
        return self.prefix_ids.numel()

    @property
    def num_micro_batches(self) -> int:
        """The prefix micro-batch plus the suffix micro-batches."""
        return 1 + len(self.suffixes)

    @property
    def tokens_computed(self) -> int:
        """Tokens the model computes over all micro-batches (the prefix once)."""
        return self.prefix_len + sum(s.plan.num_tokens_unique for s in self.suffixes)

    @property
    def num_tokens_total(self) -> int:
        return sum(self.seq_lens)

    def metrics(self, prefix: str = "prefix_sharing/") -> dict[str, float]:
        """The figures a trainer logs per step (as :meth:`MicroBatchSplit.metrics
        <prefix_sharing.batching.MicroBatchSplit.metrics>` does for a split)."""
        return {
            f"{prefix}num_micro_batches": float(self.num_micro_batches),
            f"{prefix}tokens_computed": float(self.tokens_computed),
            f"{prefix}token_ratio": self.num_tokens_total / self.tokens_computed,
            f"{prefix}prefix_recomputes_avoided": float(self.prefix_recomputes_avoided),
        }

    def plans(self) -> list[SharingPlan]:
        """Every plan of the group, prefix scoring first (for fingerprints)."""
        return [self.prefix_stats_plan] + [s.plan for s in self.suffixes]

    @property
    def prefix_recomputes_avoided(self) -> int:
        """Prefix computations a split into independent micro-batches would add (one per
        suffix micro-batch beyond the first)."""
        return len(self.suffixes) - 1


def plan_group(
    sequences: Sequence[TokenSequence],
    token_budget: int,
    config: PrefixSharingConfig | None = None,
    *,
    pad_to_multiple_of: int = 1,
) -> GroupSchedule:
    """Cuts one group into its common prefix and suffix micro-batches of at most
    ``token_budget`` computed tokens.

    The prefix is the group's longest common prefix, one token short of the shortest sequence
    (every sequence keeps a tail of at least one token). Tails are taken in lexicographic order
    and packed greedily, a branch (tails with the same first token) kept whole when it fits in
    one micro-batch.

    Args:
        sequences: the group's token ids, one unpadded 1-D sequence each (at least two).
        token_budget: computed tokens per micro-batch; the prefix must fit in one.
        config: what to share inside a suffix micro-batch (``mode`` must not be ``"off"``).
        pad_to_multiple_of: pad each suffix micro-batch's own rows to a multiple of this
            (sequence parallelism splits them over the tensor-parallel ranks); pad rows are
            not counted against the budget.

    Raises:
        ValueError: fewer than two sequences, no common prefix, the prefix or one tail over
            the budget, or sharing switched off.
    """
    config = PrefixSharingConfig() if config is None else config
    if not config.enabled:
        raise ValueError("cross-micro-batch sharing needs a sharing config (mode is 'off')")
    if config.mode != "arbitrary_prefix":
        raise ValueError(
            f"cross-micro-batch sharing plans with mode='arbitrary_prefix'; got {config.mode!r}"
        )
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1).cpu() for s in sequences]
    if len(seqs) < 2:
        raise ValueError(f"a group needs at least two sequences; got {len(seqs)}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive; got {token_budget}")
    prefix_len = common_prefix_len(seqs)
    if prefix_len < 1:
        raise ValueError("the group's sequences share no prefix (of at least one token, "
                         "leaving every sequence a tail)")
    if prefix_len > token_budget:
        raise ValueError(
            f"the group's common prefix ({prefix_len} tokens) exceeds token_budget="
            f"{token_budget}; one level of cross-micro-batch sharing needs it in one micro-batch"
        )
    seq_lens = tuple(s.numel() for s in seqs)
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    tails = [s[prefix_len:] for s in seqs]
    members = _pack(tails, token_budget, config)
    suffixes = tuple(
        _suffix(m, tails, prefix_len, starts, config, pad_to_multiple_of) for m in members
    )
    prefix_ids = seqs[0][:prefix_len]
    return GroupSchedule(
        prefix_ids=prefix_ids,
        prefix_stats_plan=_prefix_stats_plan(seqs, prefix_len),
        prefix_positions=torch.cat([torch.arange(prefix_len) + a for a in starts[:-1]]),
        suffixes=suffixes,
        seq_lens=seq_lens,
        tokens_unique=build_plan(seqs, config).num_tokens_unique,
    )


def common_prefix_len(seqs: list[torch.Tensor]) -> int:
    """The prefix :func:`plan_group` shares: the sequences' longest common prefix, at most one
    token short of the shortest (every sequence keeps a tail)."""
    limit = min(s.numel() for s in seqs) - 1
    first = seqs[0][:limit]
    same = torch.ones(limit, dtype=torch.bool)
    for s in seqs[1:]:
        same &= s[:limit] == first
    mismatch = (~same).nonzero()
    return int(mismatch[0]) if mismatch.numel() else limit


def _pack(tails: list[torch.Tensor], token_budget: int,
          config: PrefixSharingConfig) -> list[list[int]]:
    """Packs tails, in lexicographic order, by their planned (shared) cost.

    Tails with the same first token form a branch; a branch that does not fit beside the
    current micro-batch but fits alone starts a new one rather than being cut (a cut branch is
    computed in both micro-batches). A branch larger than the budget is cut tail by tail.
    """
    for i, t in enumerate(tails):
        if t.numel() > token_budget:
            raise ValueError(
                f"sequence {i}'s tail after the common prefix ({t.numel()} tokens) "
                f"exceeds token_budget={token_budget}"
            )
    order = sorted(range(len(tails)), key=lambda i: tails[i].tolist())
    branches: list[list[int]] = []
    for i in order:
        if branches and int(tails[branches[-1][0]][0]) == int(tails[i][0]):
            branches[-1].append(i)
        else:
            branches.append([i])
    bins: list[list[int]] = []
    for branch in branches:
        if bins and _cost([tails[j] for j in bins[-1] + branch], config) <= token_budget:
            bins[-1] += branch
            continue
        if _cost([tails[j] for j in branch], config) <= token_budget:
            bins.append(list(branch))
            continue
        for i in branch:  # too large for one micro-batch: cut it
            if bins and _cost([tails[j] for j in bins[-1] + [i]], config) <= token_budget:
                bins[-1].append(i)
            else:
                bins.append([i])
    return [sorted(b) for b in bins]


def _cost(tails: list[torch.Tensor], config: PrefixSharingConfig) -> int:
    return build_plan(tails, config).num_tokens_unique


def _suffix(members: list[int], tails: list[torch.Tensor], prefix_len: int, starts: list[int],
            config: PrefixSharingConfig, pad_to_multiple_of: int) -> SuffixMicroBatch:
    tail_plan = build_plan([tails[i] for i in members], config,
                           pad_to_multiple_of=pad_to_multiple_of)
    return SuffixMicroBatch(
        members=tuple(members),
        plan=_with_external_prefix(tail_plan, prefix_len),
        tail_plan=tail_plan,
        token_positions=torch.cat(
            [torch.arange(prefix_len, starts[i + 1] - starts[i]) + starts[i] for i in members]
        ),
    )


def _with_external_prefix(tail: SharingPlan, prefix_len: int) -> SharingPlan:
    """The tails' plan with ``prefix_len`` external rows in front of every key segment and
    every sequence (see the module example); a pad segment reads them too (its rows are
    never read)."""
    prefix_rows = torch.arange(prefix_len)
    kv_lens = torch.diff(tail.cu_seqlens_kv.to(torch.int64))
    gather = torch.split(tail.kv_gather_index + prefix_len, kv_lens.tolist())
    index = torch.split(tail.kv_index + prefix_len, list(tail.seq_lens))
    cu_kv = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kv_lens + prefix_len, 0)])
    return dataclasses.replace(
        tail,
        position_ids=tail.position_ids + prefix_len,
        cu_seqlens_kv=cu_kv.to(torch.int32),
        max_seqlen_kv=tail.max_seqlen_kv + prefix_len,
        cu_seqlens_kv_host=tuple(int(x) for x in cu_kv.tolist()),
        kv_gather_index=torch.cat([torch.cat([prefix_rows, g]) for g in gather]),
        kv_index=torch.cat([torch.cat([prefix_rows, x]) for x in index]),
        seq_lens=tuple(n + prefix_len for n in tail.seq_lens),
        prefix_lens=tuple(n + prefix_len for n in tail.prefix_lens),
    )


def _prefix_stats_plan(seqs: list[torch.Tensor], prefix_len: int) -> SharingPlan:
    """Plan over ``prefix_len + N`` rows for the prefix positions' log-probs (see
    :class:`GroupSchedule`); only its token-indexing fields are meaningful."""
    n = len(seqs)
    rows = torch.arange(prefix_len)
    input_ids = torch.cat([seqs[0][:prefix_len], torch.stack([s[prefix_len] for s in seqs])])
    kv_index = torch.cat([torch.cat([rows, torch.tensor([prefix_len + i])]) for i in range(n)])
    cu = torch.tensor([0, prefix_len + n], dtype=torch.int32)
    return SharingPlan(
        input_ids=input_ids,
        position_ids=torch.cat([rows, torch.full((n,), prefix_len)]),
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=prefix_len + n,
        max_seqlen_kv=prefix_len + n,
        cu_seqlens_q_host=(0, prefix_len + n),
        cu_seqlens_kv_host=(0, prefix_len + n),
        kv_gather_index=torch.arange(prefix_len + n),
        kv_index=kv_index,
        seq_lens=(prefix_len + 1,) * n,
        prefix_lens=(0,) + (prefix_len,) * (n - 1),
    )
