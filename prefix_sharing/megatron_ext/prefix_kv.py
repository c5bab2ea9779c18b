"""A group's prefix K/V, kept per layer across its suffix micro-batches.

The prefix micro-batch's core attention *records* each layer's keys and values; every suffix
micro-batch's core attention *reads* them as leaves (detached tensors that require grad),
placed before its own rows, so its backward accumulates dK/dV into the leaves' ``.grad``. After
the group's last suffix, :meth:`PrefixKV.backward` sends those sums into the prefix's graph.

An MoE router that keeps batch statistics (aux / z-losses, expert-bias counts) does the same
with the prefix's router logits (:meth:`PrefixKV.exchange_router_logits`): every suffix
micro-batch's statistics count its samples' copies of the prefix tokens, as the plain
micro-batch of those samples does, and their gradients reach the prefix's router through the
leaves.

A training loop that runs one backward per micro-batch (megatron's schedules, verl's engine)
cannot call :meth:`PrefixKV.backward` itself after the last suffix; there the last suffix
*reads through* (mode ``"read_last"``): it attends to the recorded K/V themselves, with the
leaves' accumulated gradients added on the way back (:func:`read_through`), so that suffix's own
backward runs the prefix's backward too, once, inside the same pass.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["PrefixKV", "PrefixKVStack", "read_through"]

Mode = Literal["record", "read", "read_last"]


class PrefixKV:
    """Per-layer prefix K/V (this rank's K/V heads), keyed by megatron's ``layer_number``.

    Attributes:
        mode: ``"record"`` while the prefix micro-batch runs, ``"read"`` while a suffix runs,
            ``"read_last"`` while the last suffix runs in a loop that cannot call
            :meth:`backward` (see the module doc).
        leaves: ``layer_number -> (k, v)``, each ``[Lp, ng, hn]``, detached, requiring grad.
        outputs: ``layer_number -> (k, v)`` of the last recorded pass, still in its graph
            when it ran with grad: the tensors :meth:`backward` differentiates.
        router_leaves, router_outputs: ``layer_number -> [Lp, experts]`` router logits, as
            leaves and as recorded (MoE routers with batch statistics only).
        rows: the prefix's real rows ``Lp``: a prefix micro-batch padded for sequence
            parallelism records its first ``rows`` K/V rows only (None: every row).
    """

    def __init__(self, rows: int | None = None) -> None:
        self.rows = rows
        self.mode: Mode = "record"
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.router_leaves: dict[int, torch.Tensor] = {}
        self.router_outputs: dict[int, torch.Tensor] = {}

    def exchange(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer's attention uses: its own while recording (kept),
        ``cat(prefix leaves, own)`` (``[Lp + T, ng, hn]``) while reading, ``cat(recorded
        prefix, own)`` while reading last (:func:`read_through`)."""
        if self.mode == "record":
            self.outputs[layer_number] = (key[: self.rows], value[: self.rows])
            if layer_number not in self.leaves:  # a recompute keeps the leaves and their grads
                self.leaves[layer_number] = tuple(map(_leaf, self.outputs[layer_number]))
            return key, value
        k_leaf, v_leaf = self.leaves[layer_number]
        if self.mode == "read_last":
            k_out, v_out = self.outputs[layer_number]
            k_leaf, v_leaf = read_through(k_out, k_leaf), read_through(v_out, v_leaf)
        return torch.cat([k_leaf, key]), torch.cat([v_leaf, value])

    def exchange_router_logits(self, layer_number: int, logits: torch.Tensor) -> torch.Tensor:
        """The router logits this layer's batch statistics read, ``[rows, experts]``: its own
        while recording (kept), ``cat(prefix leaf, own)`` (``[Lp + T, experts]``) while
        reading, ``cat(recorded prefix, own)`` while reading last."""
        if self.mode == "record":
            self.router_outputs[layer_number] = logits[: self.rows]
            if layer_number not in self.router_leaves:
                self.router_leaves[layer_number] = _leaf(logits[: self.rows])
            return logits
        prefix = self.router_leaves[layer_number]
        if self.mode == "read_last":
            prefix = read_through(self.router_outputs[layer_number], prefix)
        return torch.cat([prefix, logits])

    def held_bytes(self) -> int:
        """Bytes held across the group: the leaves and their accumulated gradients
        (2 x layers x Lp x K/V heads x head dim each, this rank; plus layers x Lp x experts
        for routers with batch statistics)."""
        tensors = [t for kv in self.leaves.values() for t in kv]
        tensors += list(self.router_leaves.values())
        grads = [t.grad for t in tensors if t.grad is not None]
        return sum(t.numel() * t.element_size() for t in tensors + grads)

    def backward(self, extra: list[torch.Tensor] | None = None) -> None:
        """Backward of the recorded pass with the accumulated dK/dV as incoming gradients,
        plus ``extra`` scalar losses of that pass (e.g. its own tokens' loss terms)."""
        tensors: list[torch.Tensor] = list(extra or [])
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        pairs = [pair for layer, outs in self.outputs.items()
                 for pair in zip(outs, self.leaves[layer])]
        pairs += [(out, self.router_leaves[layer]) for layer, out in self.router_outputs.items()]
        for out, leaf in pairs:
            if leaf.grad is not None and out.requires_grad:
                tensors.append(out)
                grads.append(leaf.grad)
        if not tensors:
            raise RuntimeError("nothing to backpropagate: the prefix pass ran without grad")
        torch.autograd.backward(tensors, grads)


class PrefixKVStack:
    """What one micro-batch of a nested schedule reads and records: the K/V (and router
    logits) of a stack of earlier passes, in row order, in front of its own rows, and,
    for a shared block, its own rows recorded in ``own`` (see
    :mod:`prefix_sharing.cross_micro_batch`). Takes :class:`PrefixKV`'s place in
    ``PlanPackedSeqParams.prefix_kv``; each element keeps its own mode (the stack's are
    ``"read"``, ``own``'s ``"record"``)."""

    def __init__(self, reads: list[PrefixKV], own: PrefixKV | None = None) -> None:
        self.reads, self.own = reads, own

    @property
    def mode(self) -> Mode:
        """``"record"`` for a block (its router keeps no statistic), else the readers'."""
        return "record" if self.own is not None else "read"

    def exchange(self, layer_number: int, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cat(stack's K/V..., own)``, recording own first when a block runs."""
        if self.own is not None:
            key, value = self.own.exchange(layer_number, key, value)
        for prefix in reversed(self.reads):
            key, value = prefix.exchange(layer_number, key, value)
        return key, value

    def exchange_router_logits(self, layer_number: int, logits: torch.Tensor) -> torch.Tensor:
        """A block records its own logits (it routes without statistics); a reader gets
        ``cat(stack's logits..., own)``."""
        if self.own is not None:
            return self.own.exchange_router_logits(layer_number, logits)
        for prefix in reversed(self.reads):
            logits = prefix.exchange_router_logits(layer_number, logits)
        return logits


def read_through(recorded: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``recorded`` (still in its pass's graph) for the last reader: the gradient reaching it
    gets ``leaf.grad`` (what earlier readers accumulated; read when the backward arrives)
    added, so one backward carries every reader's gradient into the recorded pass. Without
    grad (a forward-only step) it is ``recorded`` itself."""
    if not recorded.requires_grad:
        return recorded
    used = recorded.view_as(recorded)
    used.register_hook(lambda grad: grad if leaf.grad is None else grad + leaf.grad)
    return used


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)
