"""What MoE routers keep besides the loss: the logged losses and the token counts.

Shared by the MoE tests (one micro-batch, and across micro-batches): reset them before a run,
read them after it, and compare them key by key with another run's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["reset_router_statistics", "router_statistics", "routers"]


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of the model's decoder layers, in layer order (dense layers have none)."""
    return [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]


def _metrics_tracker() -> tuple[Callable[[], None], Callable[[], dict[str, torch.Tensor]]]:
    """(clear, name -> values) of megatron's MoE metrics tracker: ``get_moe_metrics_tracker()``
    where the release has it (0.17+; the older helpers are deprecated there), else 0.16.1's."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        return clear_aux_losses_tracker, lambda: {
            name: entry["values"] for name, entry in get_moe_layer_wise_logging_tracker().items()}
    tracker = get_moe_metrics_tracker()
    return tracker.clear, lambda: {name: entry.values for name, entry in tracker.metrics.items()}


def reset_router_statistics(model: torch.nn.Module) -> None:
    """Clears the aux-loss tracker, the global aux loss's counts and the expert-bias counts."""
    _metrics_tracker()[0]()
    for router in routers(model):
        router.reset_global_aux_loss_tracker()
        if router.local_tokens_per_expert is not None:
            router.local_tokens_per_expert.zero_()


def router_statistics(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the routers kept since :func:`reset_router_statistics`: the aux-loss tracker (the
    logged metrics), the expert-bias counts and the bias update they give, the global aux
    loss's token counts."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    stats = {f"tracker.{name}": values.clone() for name, values in _metrics_tracker()[1]().items()}
    for i, router in enumerate(routers(model)):
        if router.local_tokens_per_expert is not None:
            counts = router.local_tokens_per_expert.clone()
            stats[f"layer{i}.tokens_per_expert"] = counts
            stats[f"layer{i}.expert_bias_update"] = get_updated_expert_bias(
                counts.clone(), router.expert_bias, 1e-3)
        if router.global_tokens_per_expert is not None:
            stats[f"layer{i}.global_tokens_per_expert"] = router.global_tokens_per_expert.clone()
    return stats
