"""verl's ``router_replay`` in the Megatron engine with prefix sharing: the routes to replay.

verl (0.8.0 and 0.9.1) has two modes, both accepted with sharing:

- ``R3`` replays the routes the rollout engine recorded (``routed_experts`` in the batch, per
  sample ``[tokens, layers, topk]``). Each micro-batch's ``routed_experts`` become the plan's
  routes (:func:`micro_batch_routes`): the planner shares a prefix only as far as the routes
  agree, and every computed row replays its tokens' route
  (:mod:`prefix_sharing.megatron_ext.routing_replay`). verl 0.9.1 routes some rows natively
  (``build_r3_replay_mask``: each sample's last row, whose rollout route is missing; every row of
  a sample without a response): those rows get the route ``-1``, which the planner treats as a
  route of its own and the router replays as "native" through verl's replay mask. verl 0.8.0
  replays every row, as here.
- ``R2`` records routes in ``compute_log_prob``'s forward (verl sets the routers to ``RECORD``)
  and replays them in the update. The recording forward shares: the routers record the computed
  rows, and :class:`RouteRecorder` hands every plain token its row's route in verl's per-sample
  layout, in place of verl's ``merge_router_topk_indices`` (which unpacks verl's own packed
  layout) - so verl stores, gathers over pipeline stages, restores to batch order and later
  returns exactly what a forward without sharing records (a row's hidden state is each of its
  tokens'). The update then replays them like ``R3`` routes (no native rows): the plan of an
  update micro-batch is built with them, so micro-batches may be split differently in the two
  forwards.

``R3`` runs under context parallelism; ``R2``'s recording forward does not yet (refused by
:func:`replay_mode_problems`). Router statistics kept on a padded plain batch (under context or
sequence parallelism, or with a per-sequence aux loss) are refused with replay
(:func:`check_padded_statistics`): verl's replay patch drops megatron's padding mask.

verl sets the replay action on the routers inside ``forward_step``, before it calls the forward
function; :func:`router_action` reads it there, so the routes go with the micro-batch exactly
when verl would replay (or record) them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError, PrefixSharingSetupError
from ..refusals import Refused, refuse


__all__ = ["replay_mode", "replay_mode_problems", "micro_batch_routes", "split_routes",
           "router_action", "check_padded_statistics", "RouteRecorder"]


def replay_mode(engine_config: Any) -> str:
    """verl's ``router_replay.mode`` of an engine config (``"disabled"`` where it has none)."""
    return getattr(getattr(engine_config, "router_replay", None), "mode", "disabled") or "disabled"


def replay_mode_problems(engine_config: Any) -> list[Refused]:
    """The ``router_replay`` settings sharing cannot run with."""
    mode = replay_mode(engine_config)
    cp = getattr(engine_config, "context_parallel_size", 1)
    if mode == "R2" and cp > 1:
        return [Refused("verl.routing_replay.r2_context_parallel",
                        f"router_replay.mode='R2' with context_parallel_size={cp}")]
    return []


def router_action(model: Any) -> str | None:
    """The replay action verl has set on this model chunk's routers (``"record"``,
    ``"replay_forward"``, ``"replay_backward"``), or None (no replay, or no MoE layer here)."""
    for module in model.modules():
        action = getattr(getattr(module, "router_replay", None), "router_replay_action", None)
        if action is not None:
            return action.value
    return None


def check_padded_statistics(model: Any) -> None:
    """Refuses replay with router statistics kept on the padded plain batch.

    verl's router-replay patch replaces megatron's ``TopKRouter.routing`` with one that drops
    the ``padding_mask``: its z-loss, load-balancing losses and expert-bias counts take every
    position of the batch it is given. Under sharing the router gives it the plain batch
    padded per sequence whenever a rank routes a slice of it (context parallelism, or tensor
    parallelism with sequence parallelism) or a per-sequence aux loss is on
    (:meth:`~prefix_sharing.megatron_ext.moe.PrefixSharingRouter.routes_padded_batch`), so the
    padding would enter the statistics. Without statistics, or on the packed batch, replay is
    exact.
    """
    from ..megatron_ext.moe import PrefixSharingRouter

    for module in model.modules():
        if (isinstance(module, PrefixSharingRouter) and module.keeps_statistics()
                and module.routes_padded_batch()):
            raise refuse("verl.routing_replay.padded_statistics",
                         "router_replay (R2 or R3) with MoE router statistics (aux loss, z-loss "
                         "or expert bias)", error=PrefixSharingSetupError)


def micro_batch_routes(batch: Any, mode: str) -> list[torch.Tensor] | None:
    """The micro-batch's routes as the plan takes them, one ``[tokens, layers, topk]`` int64
    tensor per sample (``-1`` where verl routes natively), or None when ``mode`` replays
    nothing or (``R2``) the batch has none yet: its recording forward."""

    if mode not in ("R2", "R3"):
        return None
    routed = batch.get("routed_experts", None)
    if routed is None:
        if mode == "R2":
            return None
        raise refuse("verl.routing_replay.r3_without_routes", "router_replay.mode='R3'",
                     error=PrefixSharingSetupError)

    input_ids = batch["input_ids"]
    parts = list(routed.unbind()) if routed.is_nested else list(routed)
    lengths = input_ids.offsets().diff().tolist()
    native = _native_rows(input_ids, batch) if mode == "R3" else None
    routes = []
    for i, (part, length) in enumerate(zip(parts, lengths, strict=True)):
        part = part.to(torch.int64)
        if part.size(0) == length - 1 and native is not None:  # the last route is never recorded
            part = torch.cat([part, part.new_full((1, *part.shape[1:]), -1)])
        if part.size(0) != length:
            raise InputError(  # a malformed batch, not a refused setting
                f"router_replay: sample {i} has {part.size(0)} routes for {length} tokens")
        if native is not None:
            part = part.masked_fill(native[i].to(part.device)[:, None, None], -1)
        routes.append(part.cpu())
    return routes


def split_routes(batch: Any, mode: str) -> tuple[list[torch.Tensor] | None, bool]:
    """What a split of ``batch`` (a whole step's) plans groups across micro-batches with: its
    samples' routes (:func:`micro_batch_routes`; None without replay), and whether any group
    may cross micro-batches - not in ``R2``'s recording forward, whose routers record the rows
    they route per micro-batch (there the ordinary split runs)."""
    routes = micro_batch_routes(batch, mode)
    return routes, not (mode == "R2" and routes is None)


def _native_rows(input_ids: torch.Tensor, batch: Any) -> list[torch.Tensor] | None:
    """Per sample, the rows verl routes natively under R3 (verl 0.9.1's replay mask), or None
    where the release replays every row (0.8.0)."""
    try:
        from verl.utils.megatron.router_replay_utils import build_r3_replay_mask
    except ImportError:
        return None
    mask = build_r3_replay_mask(input_ids, batch["response_mask"])
    return [~m.bool() for m in mask.unbind()]


class RouteRecorder:
    """One micro-batch's ``R2`` recording under sharing: the shared forward says which model
    chunk ran with which plan (:meth:`ran`), and verl's per-micro-batch merge, right after that
    forward, reads the routers' recording through it (:meth:`merged`)."""

    def __init__(self) -> None:
        self._ran: tuple[Any, Any] | None = None

    def ran(self, model: Any, plan: Any) -> None:
        """The shared forward ran ``model`` (one chunk, unwrapped) with ``plan``."""
        self._ran = (model, plan)

    def merged(self) -> torch.Tensor:
        """What verl's ``merge_router_topk_indices`` appends for this micro-batch: every
        sample's routes as its plain tokens would have recorded them, a jagged
        ``[samples, tokens, moe_layers_of_this_chunk, topk]`` int16 tensor on the CPU."""
        from ..megatron_ext.routing_replay import recorded_routes

        if self._ran is None:
            raise RuntimeError("router_replay R2: verl merges recorded routes of a micro-batch "
                               "that the sharing forward did not run")
        model, plan = self._ran
        with torch.no_grad():
            parts = plan.split(recorded_routes(model, plan).to("cpu", torch.int16))
        return torch.nested.as_nested_tensor(parts, layout=torch.jagged)
