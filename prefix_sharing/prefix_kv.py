"""A group's prefix K/V, kept per layer across its suffix micro-batches.

The prefix micro-batch's attention *records* each layer's keys and values; every suffix
micro-batch's attention *reads* them as leaves (detached tensors that require grad), before its
own rows, so its backward accumulates dK/dV into the leaves' ``.grad``. After the group's last
suffix, the block's backward step sends those sums into the prefix's graph:
:meth:`PrefixKV.gradient_term` where its graph was kept, or its forward run again with grad in
mode ``"record_last"``, its own rows reading their recorded K/V with the leaves' gradients
injected (the executor, :class:`~prefix_sharing.cross_blocks.GroupBlocks`). Model-agnostic: a
layer is its number (megatron's ``layer_number``, transformers' ``layer_idx``); megatron's core
attention finds the store in its ``packed_seq_params``, transformers' attention function in the
forward's keywords (:mod:`prefix_sharing.fsdp_compat.attention`).

A reader gets the stored K/V as key sources of their own (:meth:`PrefixKVPass.key_sources`):
its attention reads them in place, all its query rows over the stored rows, merged by the
log-sum-exp with its own rows' part (:func:`~prefix_sharing.attention.prefix_attention`'s
``stored``), so no ``cat(prefix, own)`` is built. Where the attention cannot run over sources
(a backend without a with-lse pair: TE; a sliding window) it concatenates them in
front of its own rows itself, as does the context-parallel path (:meth:`PrefixKVPass.exchange`,
its gathered K/V then cut per local query piece). The gradient protocol is the same either
way: the leaves are the attention's inputs.

An MoE router that keeps batch statistics (aux / z-losses, expert-bias counts) does the same
with the prefix's router logits (:meth:`PrefixKV.exchange_router_logits`): every suffix
micro-batch's statistics count its samples' copies of the prefix tokens, as the plain
micro-batch of those samples does, and their gradients reach the prefix's router through the
leaves.

**Activation recompute.** A recomputed layer's attention is called twice in one forward, with
the same store: so each forward reads the store through its own :class:`PrefixKVPass` (its
mode fixed when the forward starts), and the second call of a layer replays the first's mode,
whatever micro-batch runs meanwhile. Two kinds of recompute:

- *reentrant* (megatron's full and selective recompute): the first run keeps no graph, the
  replay inside the backward does. A recorded layer whose first run kept no graph cannot hand
  its K/V to :meth:`PrefixKV.gradient_term` or to a last reader: it records once (the first
  run's values; the replay records nothing) and its replay, which carries the graph,
  *injects* the leaves' accumulated gradients into its own K/V (:func:`read_through` on the
  replay's K/V). The injection reads the leaves when the prefix's backward reaches that layer,
  so every reader's backward must have accumulated into them by then (the block's backward
  step comes after its last reader's); a count of the readers still owing their gradient
  checks this at every injection;
- *non-reentrant* (transformers' gradient checkpointing, as verl turns it on): both runs have
  grad, but the backward runs the first run's graph, the recompute only refilling its saved
  tensors. So the first run does what its mode asks and the recompute computes the same
  values, recording, injecting and counting nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = ["PrefixKV", "PrefixKVPass", "PrefixKVStack", "gradient_of", "in_front",
           "leaves_term", "read_through"]

Mode = Literal["record", "record_last", "read"]
KV = tuple[torch.Tensor, torch.Tensor]


class PrefixKV:
    """Per-layer prefix K/V (this rank's K/V heads), keyed by the layer's number.

    Attributes:
        mode: the mode of the next forward bound to this store (:meth:`forward_pass`, which
            :class:`~prefix_sharing.megatron_ext.packed_seq.PlanPackedSeqParams` and the HF
            shim's :func:`~prefix_sharing.fsdp_compat.model_kwargs` call): ``"record"``
            while the prefix micro-batch runs, ``"read"`` while a suffix (or a block above it) runs,
            ``"record_last"`` while the prefix runs again with grad after every reader's
            backward (its own rows read their recorded K/V with the leaves' gradients
            injected: its backward step, :class:`~prefix_sharing.cross_blocks.GroupBlocks`).
        leaves: ``layer_number -> (k, v)``, each ``[Lp, ng, hn]``, detached, requiring grad.
        outputs: ``layer_number -> (k, v)`` of the last recorded pass that kept its graph
            there (not recomputed): the tensors :meth:`gradient_term` differentiates.
        router_leaves, router_outputs: ``layer_number -> [Lp, experts]`` router logits, as
            leaves and as recorded (MoE routers with batch statistics only).
        rows: the prefix's real rows ``Lp``: a prefix micro-batch padded for sequence
            parallelism records its first ``rows`` rows only (None: every row).
        routes: ``[Lp, moe_layers, topk]`` the recorded routes its rows replayed (routing
            replay), which a reader's plain view of ``cat(prefix rows, own rows)`` replays
            too (MoE routers with batch statistics), or None.
    """

    def __init__(self, rows: int | None = None, routes: torch.Tensor | None = None) -> None:
        self.rows = rows
        self.routes = routes
        self.mode: Mode = "record"
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.router_leaves: dict[int, torch.Tensor] = {}
        self.router_outputs: dict[int, torch.Tensor] = {}
        # (layer_number, "kv" | "router") -> reader passes whose backward has not yet
        # accumulated into that layer's leaves
        self.owing: dict[tuple[int, str], int] = {}

    def forward_pass(self, mode: Mode | None = None) -> PrefixKVPass:
        """The view one forward reads the store through, its mode fixed now (``self.mode``
        when None): every call of that forward, a recomputed layer's included, uses it."""
        return PrefixKVPass(self, self.mode if mode is None else mode)

    def key_sources(self, layer_number: int, key: torch.Tensor,
                    value: torch.Tensor) -> tuple[list[KV], torch.Tensor, torch.Tensor]:
        """:meth:`PrefixKVPass.key_sources` of a pass of its own in ``self.mode`` (one call of
        a forward that is not recomputed)."""
        return self.forward_pass().key_sources(layer_number, key, value)

    def exchange(self, layer_number: int, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`PrefixKVPass.exchange` of a pass of its own in ``self.mode`` (one call of a
        forward that is not recomputed)."""
        return self.forward_pass().exchange(layer_number, key, value)

    def exchange_router_logits(self, layer_number: int, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`PrefixKVPass.exchange_router_logits` of a pass of its own in ``self.mode``."""
        return self.forward_pass().exchange_router_logits(layer_number, logits)

    def held_bytes(self) -> int:
        """Bytes held across the group: the leaves and their accumulated gradients
        (2 x layers x Lp x K/V heads x head dim each, this rank; plus layers x Lp x experts
        for routers with batch statistics)."""
        tensors = [t for kv in self.leaves.values() for t in kv]
        tensors += list(self.router_leaves.values())
        grads = [t.grad for t in tensors if t.grad is not None]
        return sum(t.numel() * t.element_size() for t in tensors + grads)

    def gradient_term(self) -> torch.Tensor:
        """A scalar whose gradient with respect to each recorded K/V (and router logits) of
        the pass that kept its graph is that leaf's accumulated gradient: added to a loss of
        that pass, its backward carries every reader's dK/dV into the pass, inside the same
        backward (its value means nothing; at least fp32). A recomputed layer's gradients
        enter through its replay instead (see the module doc)."""
        pairs = [pair for layer, outs in self.outputs.items()
                 for pair in zip(outs, self.leaves[layer])]
        pairs += [(out, self.router_leaves[layer]) for layer, out in self.router_outputs.items()]
        return leaves_term(*zip(*pairs)) if pairs else torch.zeros(())

    def _leaf(self, key: tuple[int, str], recorded: torch.Tensor) -> torch.Tensor:
        leaf = recorded.detach().requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(lambda _: self._paid(key))
        return leaf

    def _paid(self, key: tuple[int, str]) -> None:
        self.owing[key] = self.owing.get(key, 0) - 1


class PrefixKVPass:
    """One forward of one micro-batch over a group's :class:`PrefixKV`, in a fixed mode.

    An activation recompute calls a layer's attention (and router) again inside the backward
    with the same arguments (megatron's ``packed_seq_params``, transformers' keywords), so the
    same pass: the replay is the second call of that layer here, and does what its first run's
    mode asks (module doc).
    """

    def __init__(self, store: PrefixKV, mode: Mode) -> None:
        self.store = store
        self.mode: Mode = mode
        # recording: -> "graph" | "no_graph"
        self._runs: dict[tuple[int, str], str] = {}
        self._counted: set[tuple[int, str]] = set()  # reads owed by this pass's backward

    @property
    def routes(self) -> torch.Tensor | None:
        """The store's rows' replayed routes (:attr:`PrefixKV.routes`)."""
        return self.store.routes

    def key_sources(self, layer_number: int, key: torch.Tensor,
                    value: torch.Tensor) -> tuple[list[KV], torch.Tensor, torch.Tensor]:
        """The stored K/V this layer's attention reads before its own rows, one ``(k, v)``
        (``[Lp, ng, hn]`` each) per store, and its own keys and values: none and its own
        (kept) while recording; the prefix leaves while reading. The attention reads the
        stored ones in place (module doc)."""
        store = self.store
        if self.mode in ("record", "record_last"):
            return [], *self._record((layer_number, "kv"), (key, value), store.leaves,
                                     store.outputs)
        prefix = self._read((layer_number, "kv"), store.leaves[layer_number])
        return [prefix], key, value

    def exchange(self, layer_number: int, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`key_sources` concatenated, for an attention that gathers (the context-
        parallel path): its own while recording, ``cat(prefix, own)`` (``[Lp + T, ng, hn]``)
        while reading."""
        return in_front(*self.key_sources(layer_number, key, value))

    def exchange_router_logits(self, layer_number: int, logits: torch.Tensor) -> torch.Tensor:
        """The router logits this layer's batch statistics read, ``[rows, experts]``: its own
        while recording (kept: the router routes what this returns), ``cat(prefix leaf, own)``
        (``[Lp + T, experts]``) while reading."""
        store = self.store
        key = (layer_number, "router")
        if self.mode in ("record", "record_last"):
            return self._record(key, (logits,), store.router_leaves, store.router_outputs,
                                single=True)[0]
        (prefix,) = self._read(key, (store.router_leaves[layer_number],))
        return torch.cat([prefix, logits])

    def _record(self, key: tuple[int, str], tensors: tuple[torch.Tensor, ...], leaves: dict,
                outputs: dict, single: bool = False) -> tuple[torch.Tensor, ...]:
        store, layer = self.store, key[0]
        rows = tensors[0].size(0) if store.rows is None else store.rows
        recorded = tuple(t[:rows] for t in tensors)
        if layer not in leaves:  # a second prefix pass keeps the leaves and their gradients
            made = tuple(store._leaf(key, r) for r in recorded)
            leaves[layer] = made[0] if single else made
        first = key not in self._runs
        # (a slice taken without grad of a tensor that requires grad still says it does)
        graph = torch.is_grad_enabled() and recorded[0].requires_grad
        if first:
            self._runs[key] = "graph" if graph else "no_graph"
            if graph:
                outputs[layer] = recorded[0] if single else recorded
            else:
                outputs.pop(layer, None)
            if not (graph and self.mode == "record_last"):
                return tensors
        elif not graph or self._runs[key] == "graph":
            # a reentrant replay without graph, or a non-reentrant recompute (the first run's
            # graph is the one its backward runs): the same values, nothing recorded
            return tensors
        # the last pass with graph of a store its readers have all read (``record_last``), or
        # the replay of a first run without graph: the readers' gradients enter here
        got = (leaves[layer],) if single else leaves[layer]
        return tuple(torch.cat([_injected(r, leaf, key, store), t[rows:]])
                     for r, leaf, t in zip(recorded, got, tensors))

    def _read(self, key: tuple[int, str], leaves: tuple[torch.Tensor, ...]
              ) -> tuple[torch.Tensor, ...]:
        # counted on the pass's first call with grad, the one whose graph its backward runs:
        # a reentrant replay's (its first run had none) or the forward's own (a non-reentrant
        # recompute has grad again, but its graph is never backpropagated)
        if torch.is_grad_enabled() and key not in self._counted:
            self._counted.add(key)
            self.store.owing[key] = self.store.owing.get(key, 0) + len(leaves)
        return leaves


class PrefixKVStack:
    """What one micro-batch of a nested schedule reads and records: the K/V (and router
    logits) of a stack of earlier passes, in row order, in front of its own rows, and,
    for a shared block, its own rows recorded in ``own`` (see
    :mod:`prefix_sharing.cross_micro_batch`). Takes :class:`PrefixKV`'s place in
    ``PlanPackedSeqParams.prefix_kv``; each element keeps its own mode (the stack's are
    ``"read"``, ``own``'s ``"record"``)."""

    def __init__(self, reads: list[PrefixKV | PrefixKVPass],
                 own: PrefixKV | PrefixKVPass | None = None) -> None:
        self.reads, self.own = reads, own

    def forward_pass(self) -> PrefixKVStack:
        """The same stack over one forward's views of its stores (each in its own mode), so a
        recomputed layer replays them (:meth:`PrefixKV.forward_pass`)."""
        return PrefixKVStack([r.forward_pass() for r in self.reads],
                             None if self.own is None else self.own.forward_pass())

    @property
    def mode(self) -> Mode:
        """``"record"`` for a block (its router keeps no statistic), else the readers'."""
        return "record" if self.own is not None else "read"

    @property
    def routes(self) -> torch.Tensor | None:
        """The replayed routes of the stack's rows, in row order (the external rows a reader's
        plain view addresses first), or None when its blocks replay none."""
        routes = [r.routes for r in self.reads]
        return None if not routes or any(r is None for r in routes) else torch.cat(routes)

    def key_sources(self, layer_number: int, key: torch.Tensor,
                    value: torch.Tensor) -> tuple[list[KV], torch.Tensor, torch.Tensor]:
        """The stack's K/V, one source per store in row order, and own, recording own first
        when a block runs (:meth:`PrefixKVPass.key_sources`)."""
        sources: list[KV] = []
        for part in ([] if self.own is None else [self.own]) + self.reads:
            read, key, value = part.key_sources(layer_number, key, value)
            sources += read
        return sources, key, value

    def exchange(self, layer_number: int, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cat(stack's K/V..., own)``, recording own first when a block runs."""
        return in_front(*self.key_sources(layer_number, key, value))

    def exchange_router_logits(self, layer_number: int, logits: torch.Tensor) -> torch.Tensor:
        """A block records its own logits (it routes without statistics); a reader gets
        ``cat(stack's logits..., own)``."""
        if self.own is not None:
            return self.own.exchange_router_logits(layer_number, logits)
        for prefix in reversed(self.reads):
            logits = prefix.exchange_router_logits(layer_number, logits)
        return logits


def in_front(sources: list[KV], key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cat(sources' K..., key)``, ``cat(sources' V..., value)``: the rows a plan's
    ``kv_gather_index`` addresses (``key``, ``value`` themselves without sources)."""
    if not sources:
        return key, value
    return (torch.cat([*(k for k, _ in sources), key]),
            torch.cat([*(v for _, v in sources), value]))


def leaves_term(recorded: Sequence[torch.Tensor | None],
                leaves: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """A scalar whose backward carries each leaf's accumulated gradient into the tensor it was
    detached from (``recorded``, pairwise; a None pair or a recorded tensor without grad is
    skipped): :func:`gradient_of` summed."""
    terms = [gradient_of(r, leaf) for r, leaf in zip(recorded, leaves)
             if r is not None and r.requires_grad]
    return sum(terms, torch.zeros(()))  # a 0-dim CPU start adds to a term on any device


def gradient_of(recorded: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """A scalar (zero) whose gradient with respect to ``recorded`` (the tensor ``leaf`` was
    detached from) is the leaf's accumulated gradient, read when the backward reaches it (a
    pipeline schedule runs a step's forward, its loss included, before earlier steps'
    backwards have accumulated into the leaf); none while the leaf has none."""
    return _LeafGradient.apply(recorded, leaf)


class _LeafGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recorded: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf  # not an input of the graph: no gradient flows into it
        return torch.zeros((), dtype=torch.promote_types(recorded.dtype, torch.float32),
                           device=recorded.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        accumulated = ctx.leaf.grad
        if accumulated is None:
            return None, None
        return (grad * accumulated).to(accumulated.dtype), None


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


def _injected(recorded: torch.Tensor, leaf: torch.Tensor, key: tuple[int, str],
              store: PrefixKV) -> torch.Tensor:
    """:func:`read_through` for a recomputed prefix layer, checking that no reader still owes
    its gradient to the leaf when the prefix's backward reads it."""
    def check(grad: torch.Tensor) -> torch.Tensor:
        if store.owing.get(key, 0) > 0:
            raise RuntimeError(
                f"the prefix's backward reached layer {key[0]} ({key[1]}) before "
                f"{store.owing[key]} of its readers' backwards had accumulated into its leaves")
        return grad

    used = read_through(recorded, leaf)
    used.register_hook(check)
    return used
