"""What the micro-batches of one cross group share in verl's Megatron engine: the state its
first micro-batch leaves for the others (:class:`GroupState`), the prefix-position statistics
it is built from, and the output each micro-batch hands verl. Used by the forward at PP=1
(:mod:`.cross_forward`) and under pipeline parallelism (:mod:`.cross_pipeline`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..refusals import refuse
from .mcore import PrefixSharingSetupError

__all__ = ["GroupState", "Statistics", "check_temperature", "leaves_of", "prefix_statistics",
           "select_statistics", "verl_output"]


@dataclasses.dataclass
class GroupState:
    """What a group's first micro-batch leaves for the others.

    Attributes:
        prefix_kv: the prefix's K/V per layer, recorded and as leaves.
        log_probs, entropy: ``(N, Lp)`` every sample's prefix-position statistics, in the
            prefix's graph (``entropy`` ``None`` when not asked for; both ``None`` on an
            inner pipeline stage).
        leaves: the same, detached, requiring grad (what all but the last micro-batch read).
        temperature: the group's sampling temperature (all its micro-batches must agree).
    """

    prefix_kv: Any
    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    leaves: tuple[torch.Tensor, torch.Tensor | None]
    temperature: float

    def prefix_stats(self, members: list[int],
                     last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(len(members), Lp)`` statistics of these samples' prefix positions: the leaves, or
        the recorded tensors read through for the last micro-batch."""
        rows = torch.tensor(members, device=self.log_probs.device)
        return select_statistics((self.log_probs, self.entropy), self.leaves, rows, last)


Statistics = tuple[torch.Tensor, torch.Tensor | None]  # log-probs, entropy (or None)


def leaves_of(recorded: Statistics) -> Statistics:
    """Detached copies of a block's recorded statistics, requiring grad where they do: what its
    readers but the last read, so their backwards accumulate there."""
    return tuple(None if t is None else t.detach().requires_grad_(t.requires_grad)
                 for t in recorded)


def select_statistics(recorded: Statistics, leaves: Statistics, rows: torch.Tensor,
                      through: bool) -> Statistics:
    """The ``rows`` (samples) of a block's statistics: its leaves, or for its last reader
    (``through``) the recorded tensors read through (the leaves' gradients added on the way
    back: :func:`~prefix_sharing.megatron_ext.prefix_kv.read_through`)."""
    from ..megatron_ext.prefix_kv import read_through

    return tuple(None if r is None else (read_through(r, leaf) if through else leaf)
                 .index_select(0, rows) for r, leaf in zip(recorded, leaves))


def check_temperature(state: Any, temperature: float) -> None:
    """A group's micro-batches must share one sampling temperature (its prefix rows serve them
    all); ``state``: the group's, one level or nested, with the temperature of its first."""
    if temperature != state.temperature:
        raise refuse("verl.temperatures", f"a cross-micro-batch group with temperatures "
                     f"{state.temperature} and {temperature}", error=PrefixSharingSetupError)


def prefix_statistics(prefix: Any, logits: torch.Tensor, with_entropy: bool) -> Statistics:
    """``(members, length)`` log-probs (and entropy) of a block's members at its positions, from
    its pass's (:class:`~prefix_sharing.megatron_ext.cross_run.PrefixPass`) output ``logits``."""
    log_probs, entropy, _ = prefix.stats_of(logits, with_entropy)
    shape = (prefix.num_sequences, prefix.prefix_len)
    return log_probs.view(shape), None if entropy is None else entropy.view(shape)


def verl_output(prefix: tuple[torch.Tensor, torch.Tensor | None], stats: Any, tail_plan: Any,
                calculate_entropy: bool) -> dict[str, torch.Tensor]:
    """verl's output of a cross micro-batch: each sample's prefix-position statistics
    (``prefix``: ``(samples, Lp)`` log-probs and entropy) then its tail's (``stats`` over
    ``tail_plan``), as jagged nested tensors."""
    result = {"log_probs": (prefix[0], stats.log_probs)}
    if calculate_entropy:
        result["entropy"] = (prefix[1], stats.entropy)
    return {key: torch.nested.as_nested_tensor(
                [torch.cat([head, tail]) for head, tail in zip(rows, tail_plan.split(own))],
                layout=torch.jagged)
            for key, (rows, own) in result.items()}
