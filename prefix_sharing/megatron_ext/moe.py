"""Mixture-of-experts under prefix sharing: the router's batch statistics over the plain batch.

Everything an MoE layer does per token - gating, top-k, the experts - is already exact on the
flat layout. What is not are the router's *batch statistics*: the load-balancing losses
(``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``), the z-loss, the expert-bias token counts
and the logged metrics. A flat row that ``m`` sequences read stands for ``m`` tokens of the plain
batch, and a shared row belongs to every sequence that reads it.

So, while batch statistics are being kept, the router routes the *plain batch's* logits: the flat
router logits are gathered into the padded ``[s, b]`` layout of the plain micro-batch (one column
per sequence, a flat row repeated wherever a sequence reads it, padding flagged by megatron's own
``padding_mask``), megatron-core's ``TopKRouter.routing`` runs unchanged on that, and every flat row
then takes the probabilities and expert choice of one of its copies (all copies are equal). Every
statistic is therefore megatron's own, computed on exactly what megatron's stock spec sees for the
plain padded batch with its ``padding_mask``; the gradients follow through the gather. Without
``seq_aux_loss`` the view is the packed plain batch (no padding), which gives the same statistics
when one rank routes the whole batch.

Under tensor parallelism megatron-core's MoE needs sequence parallelism, and its stock spec
then routes on each rank a slice of the plain ``[s, b]`` batch along ``s`` (``s`` a multiple of
the tensor-parallel size), with per-rank statistics: the z-loss is this slice's mean divided by
the tensor-parallel size, the load-balancing losses combine this slice's probabilities with the
counts all-reduced over the group, the expert-bias counts are this slice's. So each rank gathers
the flat router logits of the whole group (``gather_from_sequence_parallel_region``: its
backward reduce-scatters, so the router weight's per-rank gradients are the stock ones), routes
its own slice of the padded plain batch exactly as the stock router does, and all-gathers the
slices' probabilities and expert choices: the copy a flat row takes may lie in another rank's
slice. The plain view is then always the padded one, since the slices decide the statistics.

Under context parallelism megatron-core's router reduces the same statistics over the tensor x
context-parallel group (``tp_cp``): the load-balancing counts all-reduced over it, each rank's
probabilities its own tokens', the expert-bias counts summed over it by ``finalize_model_grads``,
the global aux counts over ``tp_dp_cp``; the schedule scales the aux losses by the CP size, as it
does the loss, and the gradient average over CP divides it back. So the flat rows (CP slice
``c``, under sequence parallelism its TP part ``t``: chunk ``c * TP + t`` of the flat layout,
which is that rank's index in ``tp_cp``) are gathered over ``tp_cp``, each rank routes chunk
``c * TP + t`` of the padded plain batch, and the slices' probabilities and choices are
all-gathered back, exactly as under sequence parallelism with ``TP x CP`` shards. Counts, totals
and per-rank probabilities then add up to the plain batch's at CP=1 whatever the split. The
z-loss alone does not: megatron takes each rank's mean over its own tokens (divided by the
group size), which is the CP=1 mean only when every rank holds as many real tokens - never
so for a padded batch. Under CP each plain token's share of it is therefore set to what the
CP=1 router gives it, ``coeff / TP / n`` with ``n`` the real tokens of the sequence-parallel
slice that holds it at CP=1 (:attr:`PlainBatchView.z_loss_weights`), and the rank's share is
logged with ``tp_cp`` as its reduce group (their sum is the CP=1 value).

Across micro-batches (:mod:`.cross_micro_batch`: a group's prefix computed once in its own
micro-batch, its tails in suffix micro-batches) the plain micro-batch a suffix micro-batch
stands for holds its samples whole, prefix included, as the stock step running the same samples
in the same micro-batches does. So the prefix micro-batch routes its rows per token and keeps no
statistic, its router logits are kept per layer beside its K/V
(:meth:`prefix_sharing.prefix_kv.PrefixKV.exchange_router_logits`), and each suffix micro-batch
routes the plain view of ``cat(prefix logits, own logits)`` - its plan's ``kv_index`` already
addresses the prefix's rows first. Every statistic is then megatron's own on that plain
micro-batch (the global aux loss accumulates once per suffix, as once per plain micro-batch),
and the gradients of the prefix copies' aux / z-loss terms gather in the kept logits' leaf and
reach the prefix's router with the prefix's backward. Under sequence and context parallelism the
prefix's logits are recorded whole (gathered over ``tp_cp``) and a suffix routes this rank's
slice of its plain view, with the z-loss weights of the CP=1 router, as in one micro-batch.

"Sequence" in ``seq_aux_loss`` is a sequence of the micro-batch, as in megatron's padded
``[s, b]`` input. (On a plain THD batch megatron-core 0.16.1 does not read ``cu_seqlens`` there:
its ``[T, 1]`` input makes the whole micro-batch one sequence.)

Cost: the router's tensors (``num_experts`` numbers per token) are the plain batch's size, not the
flat layout's - small next to the hidden states and the experts, which stay flat; under sequence
parallelism, three all-gathers of them per layer (logits, probabilities, expert choices). Without
statistics (evaluation, no aux/z-loss, no expert bias) the flat rows are routed directly.

The plan reaches the router through the layer spec: :class:`PrefixSharingTransformerLayer`
receives ``packed_seq_params`` like every layer and hands its plan to its own router for the
duration of its forward (also when full recomputation replays that forward).

Routing replay: the recorded routes of the flat rows travel with the plan (see
:mod:`.routing_replay`); the router replays its layer's column of them, laid out like the
tokens its top-k sees (the flat rows, or the plain view), through megatron's ``RouterReplay``.
Under sequence and context parallelism that is this rank's slice: the flat rows it holds
(chunk ``c * TP + t`` of the flat layout), or the slice of the padded plain batch it routes.
A recording forward (the plan's ``record_routes``) records the flat rows; it runs without
statistics (verl records in a forward without grad), else the top-k would see the plain view.
Across micro-batches a block replays its own rows' routes, and a suffix's plain view of
``cat(prefix logits, own logits)`` replays ``cat(prefix routes, own routes)`` (the prefix's
kept with its K/V: :attr:`prefix_sharing.prefix_kv.PrefixKV.routes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    save_to_aux_losses_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..plan import SharingPlan
from ..prefix_kv import PrefixKV
from ..refusals import refuse
from .checks import UnsupportedSetupError
from .packed_seq import PlanPackedSeqParams
from .plain_batch_view import PlainBatchView, plain_batch_view
from .routing_replay import (FlatRowsRouter, check_replay_state, moe_layer_index, replaying,
                             route_column)

__all__ = ["PrefixSharingRouter", "PrefixSharingTransformerLayer"]


class PrefixSharingRouter(TopKRouter, FlatRowsRouter):
    """``TopKRouter`` whose batch statistics count tokens as the plain micro-batch holds them.

    Given a plan (by :class:`PrefixSharingTransformerLayer`), it routes the plain batch's logits
    (see the module doc) whenever megatron would keep a statistic, so ``aux_loss``,
    ``seq_aux_loss`` (each sequence is a column, as in megatron's padded ``[s, b]`` layout),
    ``global_aux_loss``, the z-loss, the expert-bias counts and the aux-loss tracker are
    megatron's own on the plain batch - under sequence parallelism, each rank's are the stock
    router's on that rank's slice of it; under context parallelism, each rank's shares add up
    over the group to the CP=1 router's (the z-loss weighted per token to that end); across
    micro-batches (given the group's :class:`~prefix_sharing.prefix_kv.PrefixKV`), each
    suffix micro-batch's are the stock router's on its samples whole, the prefix micro-batch
    keeping none.
    """

    # True while the prefix micro-batch of a group routes (its statistics are the suffixes')
    _quiet: bool = False

    def __init__(self, config: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        # kwargs: what the release's MoELayer also passes (0.17+: is_mtp_layer)
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)
        self._plan: SharingPlan | None = None
        self._prefix: PrefixKV | None = None
        # the z-loss weights of the plain slice being routed (context parallelism only)
        self._z_loss_weights: torch.Tensor | None = None
        self._routes: torch.Tensor | None = None
        self._records = False
        # The layer class that hands this router its plan (set by that layer); a router no layer
        # feeds would route the flat rows as if they were the plain batch.
        self.fed_by: str | None = None
        # Which column of the recorded routes this router replays (set by its layer; None:
        # the layer cannot say, so replay under sharing is refused).
        self.moe_layer_index: int | None = None

    @contextlib.contextmanager
    def reading(self, plan: SharingPlan | None, routes: torch.Tensor | None = None,
                records: bool = False, prefix: PrefixKV | None = None) -> Iterator[None]:
        """Routes with ``plan``'s plain batch inside the block (None: the tokens as given),
        replaying ``routes`` (``[T_flat, moe_layers, topk]``, the flat rows' recorded routes)
        when given, or recording the flat rows' routes when ``records``; ``prefix``: the
        group's prefix kept across micro-batches, if any."""
        previous = (self._plan, self._routes, self._records, self._prefix)
        self._plan, self._routes, self._records, self._prefix = plan, routes, records, prefix
        try:
            yield
        finally:
            self._plan, self._routes, self._records, self._prefix = previous

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self._plan is None:
            return super().routing(logits, padding_mask=padding_mask)
        check_replay_state(getattr(self, "router_replay", None), self._routes is not None,
                           self._records)
        if self._prefix is not None and self.keeps_statistics():
            return self._routing_across_micro_batches(logits, padding_mask)
        if self._records and self.cp_group.size() > 1:
            raise refuse("megatron.moe.record_context_parallel",
                         f"context_parallel_size={self.cp_group.size()}",
                         error=UnsupportedSetupError)
        if self._records and self._computes_statistics():
            raise refuse("megatron.moe.record_with_statistics",
                         "grad enabled with aux loss, z-loss or expert bias",
                         error=UnsupportedSetupError)
        if not self._computes_statistics():
            with replaying(getattr(self, "router_replay", None),
                           self._flat_routes(self._sharding_group())):
                return super().routing(logits, padding_mask=padding_mask)
        if padding_mask is not None:
            raise refuse("megatron.moe.padding_mask", error=UnsupportedSetupError)
        # Under sequence and/or context parallelism this rank holds a 1/shards slice of the
        # flat rows, and megatron's stock spec routes a 1/shards slice (along s) of the plain
        # [s, b] batch, its statistics reduced over the same tp x cp group.
        group = self._sharding_group()
        view = self._plain_view(group)
        flat_logits = logits.reshape(-1, self.num_experts)  # [T_flat / shards, E]
        if group is not None:  # backward: reduce-scatter, each rank's uses of every row summed
            flat_logits = gather_from_sequence_parallel_region(flat_logits, group=group)
        return self._route_plain_view(view, flat_logits, self._plain_routes(view), group)

    def routes_padded_batch(self) -> bool:
        """Whether the statistics are kept on the padded ``[s, b]`` plain batch (per-sequence
        aux loss, or a slice of it per sequence- / context-parallel rank), whose padding only
        megatron's ``padding_mask`` keeps out of them; else on the packed one (no padding)."""
        group = self._sharding_group()
        return self.get_aux_loss_coeff("seq_aux_loss") > 0 or (
            group is not None and group.size() > 1)

    def _routing_across_micro_batches(self, logits: torch.Tensor,
                                      padding_mask: torch.Tensor | None):
        """A micro-batch of a group run across micro-batches (see the module doc): the prefix
        micro-batch records its logits and routes per token without statistics; a suffix
        micro-batch routes the plain view of ``cat(prefix logits, own logits)``.

        Under sequence parallelism each rank holds a slice of the flat rows: the prefix's
        logits are recorded whole (gathered; the backward reduce-scatters each rank's
        statistics' gradients back onto the rows' owners), and a suffix routes this rank's
        slice of its padded plain view, as the stock router routes its slice of the plain
        micro-batch, the slices' probabilities and choices all-gathered back."""
        if padding_mask is not None:
            raise refuse("megatron.moe.padding_mask", error=UnsupportedSetupError)
        group = self._sharding_group()
        shards = 1 if group is None else group.size()
        replay = getattr(self, "router_replay", None)
        flat_logits = logits.reshape(-1, self.num_experts)  # [T_flat / shards, E]
        whole = flat_logits
        if shards > 1 and (self._prefix.mode == "record" or self._computes_statistics()):
            whole = gather_from_sequence_parallel_region(flat_logits, group=group)  # [T_flat, E]
        if self._prefix.mode == "record":
            # what the prefix routes carries the readers' gradients when it is recomputed
            used = self._prefix.exchange_router_logits(self.layer_number, whole)
            if shards > 1:
                used = used.chunk(shards)[group.rank()]
            self._quiet = True
            try:
                with replaying(replay, self._flat_routes(group)):
                    return super().routing(used.view_as(logits))
            finally:
                self._quiet = False
        if not self._computes_statistics():
            with replaying(replay, self._flat_routes(group)):
                return super().routing(logits)
        rows = self._prefix.exchange_router_logits(self.layer_number, whole)
        view = self._plain_view(group, external_rows=rows.size(0) - whole.size(0))
        return self._route_plain_view(view, rows, self._plain_routes(view, self._prefix.routes),
                                      group)

    def _plain_view(self, group: torch.distributed.ProcessGroup | None,
                    external_rows: int = 0) -> PlainBatchView:
        """This rank's slice of the plan's plain batch (of ``external_rows`` prefix rows and
        then the flat rows, across micro-batches), as megatron's stock spec slices it over
        ``group`` (:meth:`_sharding_group`); under context parallelism with each position's
        z-loss weight at CP=1 (see the module doc)."""
        shards = 1 if group is None else group.size()
        tp_slices = self.tp_group.size() if self.config.sequence_parallel else 1
        return plain_batch_view(self._plan, self.routes_padded_batch(), shards,
                                group.rank() if shards > 1 else 0,
                                tp_slices if self.cp_group.size() > 1 else None,
                                external_rows=external_rows)

    def _route_plain_view(self, view: PlainBatchView, rows: torch.Tensor,
                          routes: torch.Tensor | None,
                          group: torch.distributed.ProcessGroup | None):
        """Megatron's routing of ``view``'s slice of ``rows`` (every rank's rows, ``[rows,
        E]``), replaying ``routes`` (or None), then this rank's flat rows' probabilities and
        expert choices: each row's first reader's, which may lie in another rank's slice."""
        self._z_loss_weights = view.z_loss_weights
        try:
            with replaying(getattr(self, "router_replay", None), routes):
                probs, routing_map = super().routing(view.gather(rows),
                                                     padding_mask=view.padding_mask)
        finally:
            self._z_loss_weights = None
        if group is not None:
            probs = gather_from_sequence_parallel_region(probs, group=group)
            routing_map = gather_from_sequence_parallel_region(routing_map, group=group)
        return view.select(probs), view.select(routing_map)  # [T_flat / shards, E] each

    def is_aux_loss_enabled(self) -> bool:
        """Megatron's answer, except while a group's prefix micro-batch routes (its tokens'
        load-balancing terms belong to the suffix micro-batches' plain views)."""
        return not self._quiet and super().is_aux_loss_enabled()

    def _sharding_group(self) -> torch.distributed.ProcessGroup | None:
        """The group whose ranks each hold a slice of the flat rows (in group-rank order) and
        route a slice of the plain batch: tensor x context parallel under sequence
        parallelism, else context parallel; None when this rank holds every row."""
        if self.config.sequence_parallel:
            return self.tp_cp_group if self.tp_cp_group.size() > 1 else None
        return self.cp_group if self.cp_group.size() > 1 else None

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's z-loss, except under context parallelism with a plan: there each plain
        token weighs what it does at CP=1 (see the module doc), which megatron's per-rank mean
        cannot give."""
        if self._quiet:
            return logits
        weights = self._z_loss_weights
        if weights is None:
            return super().apply_z_loss(logits, padding_mask=padding_mask)
        coeff = self.config.moe_z_loss_coeff
        if coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        z_loss = (torch.logsumexp(logits, dim=-1).square() * weights.reshape(-1)).sum() * coeff
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number,
                                   self.config.num_layers + (self.config.mtp_num_layers or 0),
                                   reduce_group=self.tp_cp_group)
        return logits

    def _layer_routes(self, routes: torch.Tensor | None = None) -> torch.Tensor | None:
        """This layer's recorded route of every flat row, ``[T_flat, topk]`` (None: no replay),
        or of the rows of ``routes`` (``[rows, layers, topk]``) when given.

        The routes' second dimension is either every MoE layer of the model (verl's R2 with
        dense layers) or every layer (verl's R3, dense layers included), as verl reads them."""
        routes = self._routes if routes is None else routes
        if routes is None:
            return None
        if self.moe_layer_index is None:
            raise refuse("megatron.routing_replay.layer_index", f"a router fed by {self.fed_by}",
                         error=UnsupportedSetupError)
        if routes.size(2) != self.topk:
            raise refuse("megatron.routing_replay.routes_shape",
                         f"the replayed routes are [tokens, {routes.size(1)}, {routes.size(2)}]; "
                         f"this model routes top-{self.topk}", error=UnsupportedSetupError)
        return routes[:, route_column(self.config, self.layer_number, routes.size(1))]

    def _flat_routes(self, group: torch.distributed.ProcessGroup | None) -> torch.Tensor | None:
        """The routes of the flat rows this rank routes (its slice over ``group``, see
        :meth:`_sharding_group`)."""
        routes = self._layer_routes()
        if routes is None or group is None:
            return routes
        return routes.chunk(group.size())[group.rank()]

    def _plain_routes(self, view: PlainBatchView,
                      external: torch.Tensor | None = None) -> torch.Tensor | None:
        """The routes of the plain view's positions, ``[s / shards * b, topk]`` (s-major, as
        the top-k sees them); padding positions take flat row 0's route. ``external``: the
        routes of a group's prefix rows, which a view across micro-batches addresses first."""
        routes = self._layer_routes()
        if routes is None:
            return None
        if external is not None:
            routes = torch.cat([self._layer_routes(external.to(routes.device)), routes])
        with_sentinel = torch.cat([routes, routes[:1]])  # the sentinel row: a valid route
        return with_sentinel.index_select(0, view.rows.reshape(-1))

    def _apply_expert_bias(self, routing_map: torch.Tensor,
                           padding_mask: torch.Tensor | None = None) -> None:
        """Counts each expert's tokens for the bias update, padding excluded.

        megatron-core 0.16.1's version masks ``[tokens, experts]`` with a ``[tokens]`` mask,
        which does not broadcast; this is that count with the mask per token.
        """
        if self.enable_expert_bias and torch.is_grad_enabled() and not self._quiet:
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def keeps_statistics(self) -> bool:
        """Whether the config asks for any batch statistic of the router."""
        return (super().is_aux_loss_enabled() or self.config.moe_z_loss_coeff is not None
                or self.enable_expert_bias)

    def _computes_statistics(self) -> bool:
        """Whether this call computes one (megatron skips them without grad, and the losses
        outside training)."""
        if not torch.is_grad_enabled():
            return False
        losses = super().is_aux_loss_enabled() or self.config.moe_z_loss_coeff is not None
        return self.enable_expert_bias or (self.training and losses)


class PrefixSharingTransformerLayer(TransformerLayer):
    """``TransformerLayer`` that hands the micro-batch's plan to its MoE router.

    The layer receives ``packed_seq_params`` on every pipeline stage; the MoE layer does not. The
    plan is set on this layer's own router for the duration of the layer's forward only, so
    interleaved micro-batches and full recomputation (which replays this forward) see the right
    plan. Selective recomputation of the MoE module would replay the router outside it, so it is
    refused when the router keeps statistics.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        router = getattr(self.mlp, "router", None)
        if not isinstance(router, PrefixSharingRouter):
            raise ValueError(
                "PrefixSharingTransformerLayer needs an MoE mlp whose router is a "
                f"PrefixSharingRouter; got router={type(router).__name__}"
            )
        router.fed_by = type(self).__qualname__
        router.moe_layer_index = self._moe_layer_index()
        if self.mlp.moe_layer_recompute and router.keeps_statistics():
            raise refuse("megatron.moe.recompute",
                         "recompute_modules contains 'moe' with MoE auxiliary losses, z-loss or "
                         "expert bias", error=UnsupportedSetupError)


    def _moe_layer_index(self) -> int | None:
        """This layer's MoE ordinal over the whole model (``moe_layer_freq``), which picks its
        column of the replayed routes."""
        return moe_layer_index(self.config, self.layer_number)

    def forward(self, *args: Any, **kwargs: Any):
        params = kwargs.get("packed_seq_params")
        plan = params.plan if isinstance(params, PlanPackedSeqParams) else None
        routes = params.routes if isinstance(params, PlanPackedSeqParams) else None
        records = isinstance(params, PlanPackedSeqParams) and params.record_routes
        prefix = params.prefix_kv if isinstance(params, PlanPackedSeqParams) else None
        with self.mlp.router.reading(plan, routes, records, prefix):
            return super().forward(*args, **kwargs)
