"""Only the LM-head rows whose log-probs are consumed: the response tokens' predictors.

An RL loss reads the log-probs of response tokens only; the logits that predict prompt tokens
are computed and thrown away. On a small model the LM head (``hidden x vocab`` per row) is a
large share of the step, and in the flat layout a shared prompt is one set of rows, so keeping
only the rows that predict a response token saves most of the head's work and memory.

Position ``t`` of a sequence predicts token ``t + 1``; a response starting at token ``s``
(the prompt length) is predicted by positions ``s - 1 .. len - 2``. The selection keeps those
positions plus the last one (which predicts nothing and scores 0), so every sequence's span is
contiguous and :func:`~prefix_sharing.logprobs.token_log_probs` reads it as it reads a plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
import torch

from ..memo import derived_property
from ..plan import SharingPlan

__all__ = ["ResponseRows", "response_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class ResponseRows:
    """The kept LM-head rows, laid out the way :func:`token_log_probs` reads a plan.

    Attributes:
        rows: ``(R,)`` int64, the plan's flat rows that predict a response token, ascending:
            pass them as ``logits_to_keep`` so the LM head runs on these rows only.
        token_ids: ``(T_scored,)`` the tokens at every kept position, sequence by sequence.
        kv_index: ``(T_scored,)`` for every kept position, its row among ``rows``.
        seq_lens: kept positions per sequence (its response length + 1).
    """

    rows: torch.Tensor
    token_ids: torch.Tensor
    kv_index: torch.Tensor
    seq_lens: tuple[int, ...]

    @property
    def num_tokens_flat(self) -> int:
        return self.rows.numel()

    @derived_property
    def next_token_ids(self) -> torch.Tensor:
        """The token each kept position predicts; 0 at each sequence's last position."""
        return torch.roll(self.token_ids, -1).masked_fill(self.is_last_token, 0)

    @derived_property
    def is_last_token(self) -> torch.Tensor:
        ends = torch.tensor(self.seq_lens, device=self.kv_index.device).cumsum(0) - 1
        last = torch.zeros(self.kv_index.numel(), dtype=torch.bool, device=self.kv_index.device)
        last[ends] = True
        return last

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Per sequence, its ``response_len + 1`` values (the last is the end position's)."""
        return list(torch.split(packed, list(self.seq_lens)))


def response_rows(plan: SharingPlan, response_starts: Sequence[int]) -> ResponseRows:
    """The rows of ``plan`` that predict each sequence's response.

    Args:
        plan: the micro-batch's plan.
        response_starts: per sequence (the plan's order), the index of its first response
            token, i.e. its prompt length: at least 1 and at most the sequence's length.
    """
    if len(response_starts) != plan.num_sequences:
        raise ValueError(f"{len(response_starts)} response starts for {plan.num_sequences} "
                         "sequences")
    bad = [i for i, (s, n) in enumerate(zip(response_starts, plan.seq_lens)) if not 1 <= s <= n]
    if bad:
        i = bad[0]
        raise ValueError(f"sequence {i} has {plan.seq_lens[i]} tokens; its response cannot start "
                         f"at {response_starts[i]} (needs 1 <= start <= length)")
    # Host ints from the host-side lengths: one copy of the positions to the device, no read back.
    spans = [(n - s + 1) for s, n in zip(response_starts, plan.seq_lens)]
    offsets = itertools.accumulate(plan.seq_lens, initial=0)  # each sequence's first packed position
    firsts = [o + s - 1 for o, s in zip(offsets, response_starts)]
    positions = torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, spans)])
    flat = plan.kv_index.index_select(0, positions.to(plan.kv_index.device))
    rows, kv_index = torch.unique(flat, sorted=True, return_inverse=True)
    return ResponseRows(rows, plan.input_ids.index_select(0, flat), kv_index, tuple(spans))
