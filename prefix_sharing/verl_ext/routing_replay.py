"""verl's ``router_replay`` in the Megatron engine with prefix sharing: the routes to replay.

verl (0.8.0 and 0.9.1) has two modes. ``R3`` replays the routes the rollout engine recorded
(``routed_experts`` in the batch, per sample ``[tokens, layers, topk]``); ``R2`` records routes in
``compute_log_prob``'s forward and replays them in the update. Under sharing:

- ``R3`` is accepted. Each micro-batch's ``routed_experts`` become the plan's routes
  (:func:`micro_batch_routes`): the planner shares a prefix only as far as the routes agree, and
  every computed row replays its tokens' route (:mod:`prefix_sharing.megatron_ext.routing_replay`).
  verl 0.9.1 routes some rows natively (``build_r3_replay_mask``: each sample's last row, whose
  rollout route is missing; every row of a sample without a response): those rows get the
  route ``-1``, which the planner treats as a route of its own and the router replays as "native"
  through verl's replay mask. verl 0.8.0 replays every row, as here.
- ``R2`` is refused (:func:`replay_mode_problems`): its recording forward would record the
  flat rows' routes in verl's per-sample layout.

Router statistics kept on a padded plain batch (under context or sequence parallelism, or with
a per-sequence aux loss) are refused with replay (:func:`check_padded_statistics`): verl's
replay patch drops megatron's padding mask.

verl sets the replay action on the routers inside ``forward_step``, before it calls the forward
function; :func:`replaying_now` reads it there, so the routes go with the micro-batch exactly when
verl would replay them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["replay_mode_problems", "micro_batch_routes", "replaying_now",
           "check_padded_statistics"]


def replay_mode_problems(engine_config: Any) -> list[str]:
    """The ``router_replay`` setting sharing cannot run with, as problem strings."""
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if mode == "R2":
        return ["router_replay.mode='R2' (it records routes in a forward whose rows are shared, "
                "in verl's per-sample layout; use 'R3', which replays the rollout's routes)"]
    return []


def replaying_now(model: Any) -> bool:
    """Whether verl has set this model chunk's routers to replay (forward or recompute)."""
    for module in model.modules():
        replay = getattr(module, "router_replay", None)
        action = getattr(replay, "router_replay_action", None)
        if action is not None:
            return action.value in ("replay_forward", "replay_backward")
    return False


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
    from .mcore import PrefixSharingSetupError

    for module in model.modules():
        if (isinstance(module, PrefixSharingRouter) and module.keeps_statistics()
                and module.routes_padded_batch()):
            raise PrefixSharingSetupError(
                "router_replay.mode='R3' with prefix sharing and MoE router statistics (aux "
                "loss, z-loss or expert bias) under context_parallel_size > 1, tensor "
                "parallelism or a per-sequence aux loss: verl's replay patch drops megatron's "
                "padding mask, and the router's slice of the plain batch is padded; turn the "
                "router statistics off or use context_parallel_size=1, tensor parallel size 1")


def micro_batch_routes(batch: Any, mode: str) -> list[torch.Tensor] | None:
    """The micro-batch's routes as the plan takes them, one ``[tokens, layers, topk]`` int64
    tensor per sample (``-1`` where verl routes natively), or None when ``mode`` replays
    nothing."""
    from .mcore import PrefixSharingSetupError

    if mode != "R3":
        return None
    routed = batch.get("routed_experts", None)
    if routed is None:
        raise PrefixSharingSetupError(
            "router_replay.mode='R3' with prefix sharing: the micro-batch has no routed_experts "
            "(the rollout's routes)")
    input_ids = batch["input_ids"]
    parts = list(routed.unbind()) if routed.is_nested else list(routed)
    lengths = input_ids.offsets().diff().tolist()
    native = _native_rows(input_ids, batch)
    routes = []
    for i, (part, length) in enumerate(zip(parts, lengths, strict=True)):
        part = part.to(torch.int64)
        if part.size(0) == length - 1 and native is not None:  # the last route is never recorded
            part = torch.cat([part, part.new_full((1, *part.shape[1:]), -1)])
        if part.size(0) != length:
            raise PrefixSharingSetupError(
                f"router_replay: sample {i} has {part.size(0)} routes for {length} tokens")
        if native is not None:
            part = part.masked_fill(native[i].to(part.device)[:, None, None], -1)
        routes.append(part.cpu())
    return routes


def _native_rows(input_ids: torch.Tensor, batch: Any) -> list[torch.Tensor] | None:
    """Per sample, the rows verl routes natively under R3 (verl 0.9.1's replay mask), or None
    where the release replays every row (0.8.0)."""
    try:
        from verl.utils.megatron.router_replay_utils import build_r3_replay_mask
    except ImportError:
        return None
    mask = build_r3_replay_mask(input_ids, batch["response_mask"])
    return [~m.bool() for m in mask.unbind()]
