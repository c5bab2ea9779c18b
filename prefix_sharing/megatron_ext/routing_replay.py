"""MoE routing replay under prefix sharing: each computed row replays its recorded route.

Routing replay (megatron-core's ``moe_enable_routing_replay``, verl's ``router_replay``) makes
every MoE router take the experts recorded for each token - in the rollout, or in an earlier
forward - instead of its own top-k. Routes are recorded per plain token; a computed row stands
for every sequence that holds its token. The planner (``build_plan(routes=...)``) shares a
prefix only as far as the routes agree as well as the tokens, so all the tokens a row stands
for carry the same route, and the row replays that one.

The routes come with the micro-batch, one ``[L_i, moe_layers, topk]`` array per sequence (the
layout of verl's ``routed_experts``), and are gathered to the flat rows once per micro-batch
(:func:`flat_routes`): ``routes[first_reader(row)]``. They travel to every layer inside the
plan's ``PackedSeqParams``, like the plan, so pipeline stages and full recomputation see the
same ones without a global queue. Each router then hands its layer's column, laid out the way
its top-k sees tokens (the flat rows, or the plain batch view when it keeps batch statistics,
see :mod:`.moe`), to megatron's own replay mechanism for the duration of the call
(:func:`replaying`): the router's ``RouterReplay`` instance, which only exists when the config
asks for replay, set to replay those indices and restored afterwards.

Recording (verl's ``R2``: routes recorded in one forward, replayed in a later one) runs over the
computed rows: a flat row's hidden state is each of its plain tokens', so its top-k is theirs.
A forward that records asks for it (``prepare_micro_batch(record_routes=True)``); each router
then records the flat rows it routes, and :func:`recorded_routes` gathers them (over the
sequence-parallel group) and hands every plain token its row's route - the recording a
forward without sharing makes, in the packed plain order.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..plan import SharingPlan
from ..refusals import refuse
from .checks import UnsupportedSetupError
from .plain_batch_view import plain_batch_view

__all__ = ["FlatRowsRouter", "flat_routes", "moe_layer_index", "num_moe_layers", "route_column",
           "replaying", "check_replay_state", "recorded_routes"]


class FlatRowsRouter:
    """What a router that routes a plan's flat rows is (:class:`.moe.PrefixSharingRouter`):
    its recording is of those rows, which :func:`recorded_routes` hands back per plain token.
    A base here, so that this module finds such routers without importing :mod:`.moe`, which
    replays through it. No state of its own, so a router's class can still be swapped."""

    __slots__ = ()


def flat_routes(plan: SharingPlan, routes: Sequence[Any],
                device: torch.device | str | None = None) -> torch.Tensor:
    """The recorded route of every flat row: ``[T_flat, moe_layers, topk]`` int64.

    Args:
        plan: the micro-batch's plan, built with the same ``routes``.
        routes: one ``[L_i, moe_layers, topk]`` integer array per sequence (plan order).
        device: where the model runs (the plan's device when omitted).

    Each computed row takes the route of one plain token that reads it (all of them agree when
    the plan was built with these routes); the plan's pad rows, which nobody reads, take the
    first token's route (valid expert ids; their outputs are never used).
    """
    packed = torch.cat([torch.as_tensor(r) for r in routes]).to(torch.int64)
    if packed.dim() != 3 or packed.size(0) != plan.num_tokens_total:
        raise ValueError(
            f"routes must be one [tokens, moe_layers, topk] array per sequence, "
            f"{plan.num_tokens_total} tokens in all; got {tuple(packed.shape)} packed")
    readers = plain_batch_view(plan, per_sequence=False).readers.to(packed.device)
    rows = packed.index_select(0, readers)
    return rows.to(plan.kv_index.device if device is None else device, non_blocking=True)


def _moe_pattern(config: Any) -> list[int]:
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def num_moe_layers(config: Any) -> int:
    """MoE layers of the whole model (GPTModel: ``moe_layer_freq`` over ``num_layers``)."""
    return sum(_moe_pattern(config))


def moe_layer_index(config: Any, layer_number: int) -> int:
    """The MoE layer ordinal (0-based, over the whole model, as verl's ``routed_experts`` and
    megatron's replay list number them) of the 1-based global ``layer_number``."""
    return sum(_moe_pattern(config)[: layer_number - 1])


def route_column(config: Any, layer_number: int, width: int) -> int:
    """The column of ``[tokens, width, topk]`` recorded routes that the MoE layer numbered
    ``layer_number`` (1-based, global) replays: ``width`` is either the model's MoE layers
    (verl's R2, megatron's replay list) or all its layers (verl's R3 ``routed_experts``, dense
    layers included), as verl reads them."""
    moe_layers, layers = num_moe_layers(config), config.num_layers
    if width == moe_layers:
        return moe_layer_index(config, layer_number)
    if width == layers:
        return layer_number - 1
    raise refuse("megatron.routing_replay.routes_shape",
                 f"the replayed routes hold {width} layers; this model has {moe_layers} MoE "
                 f"layers of {layers} layers", error=UnsupportedSetupError)


def _action(replay: Any, name: str) -> Any:
    """``name`` of the replay's own action enum (megatron's or verl's ``RouterReplayAction``)."""
    return sys.modules[type(replay).__module__].RouterReplayAction(name)


def _action_name(replay: Any) -> str | None:
    action = replay.router_replay_action
    return None if action is None else action.value


def check_replay_state(replay: Any, has_routes: bool, records: bool = False) -> None:
    """Refuses a router replay state that sharing cannot serve, when a plan is read.

    ``replay`` is the router's ``RouterReplay`` (None unless the config asks for replay).
    Megatron's own replay targets and recordings are laid out per token of the model's input;
    the flat layout is not that, so a plan's routes must come with the micro-batch, and a
    recording is of the flat rows: it is accepted only from a forward that asked to record
    (``records``), whose caller reads it with :func:`recorded_routes`.
    """
    if replay is None:
        if has_routes:
            raise refuse("megatron.routing_replay.off", "moe_enable_routing_replay=False",
                         error=UnsupportedSetupError)
        return
    action = _action_name(replay)
    if action == "record":
        if not records:
            raise refuse("megatron.routing_replay.record_unplanned",
                         "router replay action RECORD with a sharing plan",
                         error=UnsupportedSetupError)
        return
    if records:
        raise refuse("megatron.routing_replay.record_action",
                     f"the router replay action is {action}", error=UnsupportedSetupError)
    if action is not None and not has_routes:
        raise refuse("megatron.routing_replay.no_routes",
                     f"router replay action {action.upper()}", error=UnsupportedSetupError)


@contextlib.contextmanager
def replaying(replay: Any, indices: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``replay`` (a router's ``RouterReplay``) replays ``indices``
    (``[tokens, topk]``, the tokens as the router's top-k sees them); its own state - action,
    targets, backward queue - is restored afterwards. ``indices=None``: nothing changes.

    Rows whose route is ``-1`` (not recorded) are routed natively where the replay takes a mask
    (verl 0.9.1's ``RouterReplay``); megatron-core's replays every row, so routes handed to it
    must all be recorded."""
    if indices is None:
        yield
        return
    saved = {name: getattr(replay, name) for name in
             ("router_replay_action", "target_topk_idx", "target_replay_mask")
             if hasattr(replay, name)}
    replay.router_replay_action = _action(replay, "replay_forward")
    if "target_replay_mask" in saved:  # verl 0.9.1's: a route of -1 is routed natively
        replay.target_replay_mask = indices[:, 0] >= 0
        indices = indices.clamp(min=0)
    replay.target_topk_idx = indices
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(replay, name, value)


def recorded_routes(model: torch.nn.Module, plan: SharingPlan) -> torch.Tensor:
    """Every plain token's route as a recording forward with ``plan`` left it in ``model``'s
    routers: ``[T_total, routers, topk]`` int64, sequences packed in plan order, the routers
    (this model chunk's, e.g. one pipeline stage's) in layer order.

    Each router recorded the flat rows it routed (under sequence parallelism, its slice); the
    slices are all-gathered over that group and every plain token takes its row's route
    (``kv_index``). A chunk without MoE layers gives ``[T_total, 0, topk]``.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    routers = sorted((m for m in model.modules() if isinstance(m, FlatRowsRouter)),
                     key=lambda router: router.layer_number)
    kv_index = plan.kv_index
    if not routers:
        topk = model.config.moe_router_topk
        return torch.empty(plan.num_tokens_total, 0, topk, dtype=torch.int64,
                           device=kv_index.device)
    missing = [r.layer_number for r in routers
               if getattr(getattr(r, "router_replay", None), "recorded_topk_idx", None) is None]
    if missing:
        raise refuse("megatron.routing_replay.nothing_recorded",
                     f"the routers of layers {missing}", error=UnsupportedSetupError)

    rows = torch.stack([r.router_replay.recorded_topk_idx.to(torch.int64) for r in routers],
                       dim=1)  # [T_flat / shards, routers, topk]
    group = routers[0]._sharding_group()
    if group is not None:  # [T_flat, routers, topk]: every rank's slice, in group-rank order
        rows = gather_from_sequence_parallel_region(rows, tensor_parallel_output_grad=False,
                                                    group=group)
    if rows.size(0) != plan.num_tokens_flat:
        raise ValueError(f"the routers recorded {rows.size(0)} rows; the plan has "
                         f"{plan.num_tokens_flat}")
    return rows.index_select(0, kv_index.to(rows.device))  # [T_total, routers, topk]
