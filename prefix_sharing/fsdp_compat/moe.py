"""The MoE load-balancing loss of a shared forward, equal to the plain forward's.

HF's Switch-style auxiliary loss averages, over tokens, which experts each token picks and
the router's probabilities. In the flat layout a shared prefix token appears once, but the
plain forward counts it once per sequence holding it. Weighting every flat row by its
multiplicity (how many packed positions read it: ``bincount(plan.kv_index)``; 0 for pad rows)
restores the plain average exactly. Routing itself is per token, so the layer outputs need
nothing: only this statistic sees the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..plan import SharingPlan

__all__ = ["row_multiplicity", "router_aux_loss"]


def row_multiplicity(plan: SharingPlan) -> torch.Tensor:
    """``(T_flat,)`` float32: how many packed positions of the micro-batch each flat row stands for."""
    return torch.bincount(plan.kv_index, minlength=plan.num_tokens_flat).float()


def router_aux_loss(
    router_logits: Sequence[torch.Tensor], plan: SharingPlan, num_experts: int, top_k: int
) -> torch.Tensor:
    """The load-balancing loss the plain forward of the plan's sequences would report.

    Args:
        router_logits: one ``(T_flat, num_experts)`` tensor per MoE layer (the model output's
            ``router_logits`` for the flat layout).
        plan: the micro-batch's plan.
        num_experts, top_k: the model config's ``num_experts`` and ``num_experts_per_tok``.
    """
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    if not router_logits or router_logits[0].size(0) != plan.num_tokens_flat:
        got = tuple(router_logits[0].shape) if router_logits else "none"
        raise ValueError(f"router_logits must be (T_flat={plan.num_tokens_flat}, experts) per "
                         f"layer; got {got}")
    # The loss's attention_mask is a per-row weight (it is multiplied in, not tested for truth).
    weights = row_multiplicity(plan).to(router_logits[0].device)
    return load_balancing_loss_func(tuple(router_logits), num_experts, top_k, weights[None])
