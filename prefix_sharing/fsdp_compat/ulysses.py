"""DeepSpeed-Ulysses sequence parallelism around the sharing attention of a HuggingFace model.

Each rank of the Ulysses group holds an equal slice of the plan's flat rows
(:mod:`prefix_sharing.row_split`) and runs every layer but attention on it. Attention needs
every row a query's segment reads - a reuser's rows may sit on one rank and its provider's
prefix on another - so around it one all-to-all gathers the sequence and scatters the heads:
each rank then holds the *whole* flat layout for ``nheads / n`` of the heads and runs
:func:`~prefix_sharing.attention.prefix_attention` on it with the whole plan, exactly as the
single-rank forward does for those heads. The inverse all-to-all gives each rank its rows back
with every head. Heads are independent in attention, so this is exact.

Grouped-query attention with fewer K/V heads than ranks: each K/V head is repeated
``n / nheads_k`` times first (head ``j`` becomes heads ``j * r .. j * r + r - 1``, as verl's
Ulysses and ``repeat_kv`` do), so that every rank receives the K/V head its queries read;
query head ``i`` still reads K/V head ``i // (nheads / nheads_k)``.

Log-probs and entropy (:func:`ulysses_token_stats`): each rank scores the packed positions
whose flat row it holds, and one all-reduce gives every rank every position. Its backward
multiplies the gradient by the group size, as verl's gather of the log-probs does
(``verl.utils.ulysses.Gather``, ``grad_scaler=True``): every rank of the group computes the
same loss from the same gathered outputs and FSDP averages gradients over all ranks, data- and
sequence-parallel alike.

The split travels in the model's keywords (:data:`SPLIT_KWARG`, beside the plan), which
transformers passes unchanged to every layer's attention function; gradient checkpointing
replays the layer with the same keywords.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..attention import prefix_attention
from ..logprobs import TokenStats, token_log_probs
from ..plan import SharingPlan
from ..row_split import RowSplit, split_rows

__all__ = ["SPLIT_KWARG", "UlyssesSplit", "ulysses_split", "ulysses_model_kwargs",
           "ulysses_attention", "ulysses_token_stats", "repeat_kv_heads"]

SPLIT_KWARG = "sharing_ulysses"  # the forward keyword carrying the UlyssesSplit


@dataclasses.dataclass(frozen=True, eq=False)
class UlyssesSplit:
    """A micro-batch's plan split over a Ulysses group.

    Attributes:
        group: the Ulysses (sequence-parallel) process group.
        rows: this rank's rows of the plan and the positions it scores.
    """

    group: torch.distributed.ProcessGroup
    rows: RowSplit

    @property
    def size(self) -> int:
        return self.rows.size


def ulysses_split(plan: SharingPlan, group: torch.distributed.ProcessGroup) -> UlyssesSplit:
    """This rank's :class:`UlyssesSplit` of ``plan`` (padded to a multiple of the group's size)."""
    size = torch.distributed.get_world_size(group)
    return UlyssesSplit(group, split_rows(plan, torch.distributed.get_rank(group), size))


def ulysses_model_kwargs(plan: SharingPlan, split: UlyssesSplit) -> dict:
    """What changes in :func:`~prefix_sharing.fsdp_compat.model_kwargs` on a Ulysses rank: its
    rows of the flat layout, and the split for the attention."""
    return {"input_ids": split.rows.rows(plan.input_ids)[None],
            "position_ids": split.rows.rows(plan.position_ids)[None],
            SPLIT_KWARG: split}


def repeat_kv_heads(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``(T, nheads_k, d)`` -> ``(T, nheads_k * repeats, d)``, each head repeated in place."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=1)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SharingPlan,
    split: UlyssesSplit,
    *,
    sinks: torch.Tensor | None = None,
    key_sources: Callable | None = None,
    **attention_kwargs: Any,
) -> torch.Tensor:
    """:func:`~prefix_sharing.attention.prefix_attention` of this rank's rows (module doc).

    Args:
        q: ``(T_flat / n, nheads, headdim)``, this rank's rows.
        k, v: ``(T_flat / n, nheads_k, headdim)``.
        plan: the whole micro-batch's plan.
        split: the plan's split over the Ulysses group.
        sinks: ``(nheads,)`` per-head sink logits, or ``None``.
        key_sources: in a micro-batch of a group across micro-batches, ``(k, v) -> (stored,
            k, v)`` (its store's :meth:`~prefix_sharing.prefix_kv.PrefixKVStack.key_sources`
            for the layer), called on the whole rows of this rank's heads: a block records
            them, a reader reads its blocks' (recorded the same way) in place.
        attention_kwargs: ``prefix_attention``'s other keywords.

    Returns:
        ``(T_flat / n, nheads, headdim)``.
    """
    n, heads, kv_heads = split.size, q.size(1), k.size(1)
    if heads % n or (kv_heads % n and n % kv_heads):
        raise ValueError(f"Ulysses over {n} ranks needs the query heads ({heads}) to divide by "
                         f"{n}, and the K/V heads ({kv_heads}) to divide by it or divide it")
    repeats = max(n // kv_heads, 1)
    k, v = repeat_kv_heads(k, repeats), repeat_kv_heads(v, repeats)
    q, k, v = (_AllToAll.apply(x, split.group, True) for x in (q, k, v))  # (T_flat, h / n, d)
    if sinks is not None:  # this rank's heads
        per_rank = heads // n
        sinks = sinks[split.rows.rank * per_rank:(split.rows.rank + 1) * per_rank]
    stored = ()
    if key_sources is not None:
        stored, k, v = key_sources(k, v)
    out = prefix_attention(q, k, v, plan, sinks=sinks, stored=stored, **attention_kwargs)
    return _AllToAll.apply(out, split.group, False)  # (T_flat / n, h, d)


class _AllToAll(torch.autograd.Function):
    """``to_heads``: ``(T / n, H, d)`` rows of every rank -> ``(T, H / n, d)``, the whole
    sequence for this rank's heads (rank ``r``: heads ``[r H / n, (r + 1) H / n)``); else the
    inverse. The backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_to_all(grad, ctx.group, not ctx.to_heads), None, None


def _all_to_all(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    n = torch.distributed.get_world_size(group)
    if to_heads:  # send head chunk j of my rows to rank j; receive my heads of rank j's rows
        rows, heads, d = x.shape
        send = x.reshape(rows, n, heads // n, d).transpose(0, 1).contiguous()
    else:  # send rows chunk j of my heads to rank j; receive my rows of rank j's heads
        send = x.reshape(n, x.size(0) // n, *x.shape[1:]).contiguous()
    received = torch.empty_like(send)  # [n, rows, heads per rank, d], indexed by source rank
    torch.distributed.all_to_all_single(received, send, group=group)
    if to_heads:
        return received.reshape(-1, *received.shape[2:])
    return received.transpose(0, 1).reshape(received.size(1), -1, received.size(-1))


def ulysses_token_stats(
    logits: torch.Tensor,
    plan: SharingPlan,
    split: UlyssesSplit,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> TokenStats:
    """Every packed position's log-probs (and entropy), ``(T_total,)`` in ``plan``'s order, on
    every rank of the group, from this rank's ``(T_flat / n, vocab)`` logits (module doc)."""
    rows = split.rows
    local = token_log_probs(logits, plan, temperature=temperature, with_entropy=with_entropy,
                            positions=rows.positions, row_start=rows.row_start)
    stats = torch.stack([s for s in local if s is not None])
    packed = stats.new_zeros(stats.size(0), plan.num_tokens_total)
    packed = _SumOverGroup.apply(packed.index_copy(1, rows.positions, stats), split.group)
    return TokenStats(packed[0], packed[1] if with_entropy else None)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the Ulysses group; the backward scales by the group size (verl's
    ``grad_scaler``; module doc)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.size = torch.distributed.get_world_size(group)
        x = x.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.size, None
