"""The sharing plan: which tokens a micro-batch computes, and where every token's state lives.

One plan is built per micro-batch (see :mod:`prefix_sharing.planner`) and read by every layer.
It is a frozen bundle of index tensors; nothing in it depends on the model. What is derived
from it (the token views below, a window's keys, the recurrence schedule) is built once per
plan and freed with it (:mod:`prefix_sharing.memo`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import torch

from .memo import derived_property

__all__ = ["SharingPlan"]


@dataclasses.dataclass(frozen=True, eq=False)
class SharingPlan:
    """Flat layout of the tokens a micro-batch computes, and the index that restores the rest.

    Worked example: three sequences, ``a = [5 6 7 8]``, ``b = [5 6 7 9 9]`` and ``c = [5 6]``,
    with every prefix shared (``min_prefix_len=1``). ``a`` computes all its 4 tokens, ``b`` reuses
    ``a``'s first three and computes ``[9 9]``, ``c`` is a strict prefix of both and computes
    nothing::

        input_ids     = [5 6 7 8 | 9 9]        flat layout, T_flat = 6 rows
        position_ids  = [0 1 2 3 | 3 4]        b's tail starts at its prefix length, 3
        cu_seqlens_q  = [0 4 6]                one query segment per sequence that owns tokens
        cu_seqlens_kv = [0 4 9]                the same segments' full lengths (4 and 5)
        cu_seqlens_q_host = (0, 4, 6)          the same boundaries as host ints
        cu_seqlens_kv_host = (0, 4, 9)
        kv_gather_index = [0 1 2 3 | 0 1 2 4 5]  rows to gather K/V from, segment by segment
        kv_index      = [0 1 2 3 | 0 1 2 4 5 | 0 1]  every token of a, b, c (given order)
        prefix_lens   = (0, 3, 2)
        prefix_runs_host = (((), ((0, 3),))   b's prefix keys are flat rows 0..2, in place

    A query segment's queries are the *tail* of its keys, so attention is causal aligned
    bottom-right: query ``i`` of a tail of length ``s`` over ``L`` keys sees keys ``0..L-s+i``.

    Attributes:
        input_ids: ``(T_flat,)`` int64, the token ids computed, each owning sequence's tail
            contiguous, sequences in the given order, then ``num_padding`` pad tokens.
        position_ids: ``(T_flat,)`` int64, position of each computed token in its own sequence.
        cu_seqlens_q: ``(M + 1,)`` int32, query segment boundaries in the flat layout.
        cu_seqlens_kv: ``(M + 1,)`` int32, key/value segment boundaries in the gathered K/V.
        max_seqlen_q, max_seqlen_kv: longest query / key segment.
        cu_seqlens_q_host, cu_seqlens_kv_host: ``cu_seqlens_q`` / ``cu_seqlens_kv`` as python
            ints, computed by the planner on the host: kernels that take host boundaries
            (torch, Ascend) read them without a device-to-host copy in every layer.
        kv_gather_index: ``(cu_seqlens_kv[-1],)`` int64, for each key segment the flat rows that
            hold its keys: ``k_segments = k_flat.index_select(0, kv_gather_index)``.
        kv_index: ``(T_total,)`` int64, for every token of every sequence (packed, given order)
            the flat row that computed it. ``restore`` and the log-probs read through it.
        seq_lens: token count of each sequence, in the given order.
        prefix_lens: how many leading tokens each sequence takes from another one.
        prefix_runs_host: per query segment, the runs of flat rows ``(start, stop)`` its
            prefix keys are, in logical order (the segment's own rows follow them): its key
            sources read in place (:mod:`prefix_sharing.attention.sources`). ``None`` where
            unknown (a plan not built by the planner): attention then gathers.
        external_rows: K/V rows in front of the flat rows that this plan does not compute:
            a cross-micro-batch stack of stored blocks (:mod:`prefix_sharing.cross_micro_batch`),
            read whole by every query segment before its own keys. ``kv_gather_index`` then
            addresses ``cat(external rows, flat rows)``; ``prefix_runs_host`` the flat rows
            only (the attention reads the stored K/V as key sources of their own).
        num_padding: pad rows at the end of the flat layout (their own causal segment, so they
            never touch a real token; see ``build_plan(pad_to_multiple_of=...)``).
        route_divergent_prefix_tokens: planned with recorded routes (``build_plan(routes=...)``,
            routing replay): how many more tokens this plan computes than a plan of the tokens
            alone would, because routes differ inside token-identical prefixes (each such
            prefix ends at the first token whose routes differ). 0 without routes.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    cu_seqlens_q_host: tuple[int, ...]
    cu_seqlens_kv_host: tuple[int, ...]
    kv_gather_index: torch.Tensor
    kv_index: torch.Tensor
    seq_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    prefix_runs_host: tuple[tuple[tuple[int, int], ...], ...] | None = None
    external_rows: int = 0
    num_padding: int = 0
    route_divergent_prefix_tokens: int = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens_total(self) -> int:
        """Tokens of all sequences: what the plain forward computes."""
        return self.kv_index.numel()

    @property
    def num_tokens_unique(self) -> int:
        """Tokens this plan computes (padding excluded)."""
        return self.input_ids.numel() - self.num_padding

    @property
    def num_tokens_flat(self) -> int:
        """Rows of the flat layout, padding included: the model's sequence length."""
        return self.input_ids.numel()

    @property
    def has_sharing(self) -> bool:
        """False for the identity plan: then K/V need no gather and the layout is plain THD."""
        return self.num_tokens_unique < self.num_tokens_total

    @property
    def has_kv_gather(self) -> bool:
        """Whether some query segment reads keys beyond its own rows (a reused prefix), so
        attention must gather K/V through ``kv_gather_index``. False for the identity plan, and
        for a plan whose reusers are all strict prefixes of other sequences (step-wise chains:
        each earlier step lies inside the last one): there every segment's keys are its own
        rows, the gather would be the identity, and only the log-probs read shared rows."""
        return self.cu_seqlens_kv_host != self.cu_seqlens_q_host

    @property
    def token_ratio(self) -> float:
        return self.num_tokens_total / self.num_tokens_unique

    @derived_property
    def cu_seqlens(self) -> torch.Tensor:
        """``(N + 1,)`` int64 offsets of each sequence in packed (``kv_index``) order."""
        lens = torch.tensor((0,) + self.seq_lens, dtype=torch.int64)
        return lens.cumsum(0).to(self.kv_index.device)

    # ------------------------------------------------------------ token views
    @derived_property
    def token_ids(self) -> torch.Tensor:
        """``(T_total,)`` every sequence's tokens, packed in the given order."""
        return self.input_ids.index_select(0, self.kv_index)

    @derived_property
    def next_token_ids(self) -> torch.Tensor:
        """``(T_total,)`` the token each position predicts; 0 at each sequence's last position."""
        nxt = torch.roll(self.token_ids, -1)
        return nxt.masked_fill(self.is_last_token, 0)

    @derived_property
    def is_last_token(self) -> torch.Tensor:
        """``(T_total,)`` bool, True at the last position of each sequence (nothing to predict)."""
        last = torch.zeros(self.num_tokens_total, dtype=torch.bool, device=self.kv_index.device)
        last[self.cu_seqlens[1:] - 1] = True
        return last

    # -------------------------------------------------------------- restoring
    def restore(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-sequence packed rows ``(T_total, ...)`` from flat rows ``(T_flat, ...)``.

        Row ``p`` of sequence ``r`` comes from the flat row that computed it, so a reuser's
        "prefix-last" output (whose logits predict its first own token) is simply the provider's.
        Differentiable: the backward scatter-adds into the flat rows.
        """
        if flat.size(0) != self.num_tokens_flat:
            raise ValueError(
                f"restore expects {self.num_tokens_flat} flat rows (the plan's layout); "
                f"got a tensor of shape {tuple(flat.shape)}"
            )
        return flat.index_select(0, self.kv_index)

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Splits a packed ``(T_total, ...)`` tensor into one tensor per sequence."""
        return list(torch.split(packed, list(self.seq_lens)))

    # ----------------------------------------------------------------- moving
    def to(self, device: torch.device | str, non_blocking: bool = False) -> SharingPlan:
        """The same plan with its index tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def digest(self) -> str:
        """A short fingerprint of the layout; equal plans on different ranks give equal digests."""
        h = hashlib.blake2b(digest_size=8)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().numpy().tobytes())
            else:
                h.update(repr(value).encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return (
            f"SharingPlan(sequences={self.num_sequences}, tokens_total={self.num_tokens_total}, "
            f"tokens_unique={self.num_tokens_unique}, segments={self.cu_seqlens_q.numel() - 1}, "
            f"padding={self.num_padding})"
        )
