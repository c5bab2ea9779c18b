"""Setups where sharing would change the results, refused with the setting that causes it.

Two kinds: *structural* settings the prefix-sharing attention cannot serve at all (checked when
the layer is built), and settings that are harmless on the plain layout but not once a prefix is
shared (checked per micro-batch, only when the plan shares something).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from ..errors import UnsupportedSetup
from ..plan import SharingPlan
from ..refusals import Refused, refuse, refuse_all

__all__ = ["UnsupportedSetupError", "check_layer_config", "check_sharing_allowed", "assert_same_plan"]


class UnsupportedSetupError(UnsupportedSetup, RuntimeError):
    """A model or parallel setting under which prefix sharing would not give the plain results.

    An :class:`~prefix_sharing.errors.UnsupportedSetup` (bad input: one line in the
    ``prefix-sharing`` command, also from a spawned rank) and, as it always was, a
    ``RuntimeError``.
    """


def check_layer_config(config: TransformerConfig) -> None:
    """Refuses settings the prefix-sharing core attention cannot serve."""
    found = []
    if config.context_parallel_size > 1:
        found += _context_parallel_problems(config)
    if getattr(config, "experimental_attention_variant", None) == "dsa":  # megatron-core 0.16+
        found.append(Refused("megatron.dsa", "experimental_attention_variant='dsa'"))
    mtp_layers = getattr(config, "mtp_num_layers", None)
    if mtp_layers:
        found.append(Refused("megatron.mtp", f"mtp_num_layers={mtp_layers}"))
    if getattr(config, "mrope_section", None) is not None:
        found.append(Refused("megatron.mrope", "mrope_section is set"))
    if config.window_size is not None and config.window_size[1] != 0:
        found.append(Refused("megatron.window_reads_later_keys",
                             f"window_size={config.window_size}; use window_size="
                             f"({config.window_size[0]}, 0)"))
    virtual_stages = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if virtual_stages is not None and virtual_stages > 1:
        found.append(Refused("megatron.virtual_pipeline",
                             f"virtual_pipeline_model_parallel_size={virtual_stages}"))
    if config.apply_rope_fusion and config.multi_latent_attention:
        # GPT attention keeps the fused kernel: PrefixSharingSelfAttention hands it one
        # rotary row per flat token (TE's BSHD format); MLA's fused kernels take cu_seqlens.
        found.append(Refused("megatron.rope_fusion",
                             "apply_rope_fusion=True with multi_latent_attention=True"))
    if found:
        raise refuse_all(found, error=UnsupportedSetupError)


def _context_parallel_problems(config: TransformerConfig) -> list[Refused]:
    """What the context-parallel attention (:mod:`.context_parallel`) and the MoE router's
    context-parallel statistics (:mod:`.moe`) have not been validated with; each is named with
    the setting that turns it off."""
    found = []
    if config.num_moe_experts and config.calculate_per_token_loss:
        found.append(Refused(
            "megatron.context_parallel.moe_per_token_loss",
            f"context_parallel_size={config.context_parallel_size} with num_moe_experts and "
            "calculate_per_token_loss=True"))
    return found


def check_sharing_allowed(config: TransformerConfig, plan: SharingPlan, training: bool) -> None:
    """Refuses settings under which a *shared* prefix would change the results."""
    if not plan.has_sharing:
        return
    found = []
    if training and config.hidden_dropout > 0:
        found.append(Refused("megatron.hidden_dropout", f"hidden_dropout={config.hidden_dropout}"))
    if config.num_moe_experts:
        found += _moe_problems(config, training)
    if found:
        raise refuse_all(found, error=UnsupportedSetupError)


def _moe_problems(config: TransformerConfig, training: bool) -> list[Refused]:
    """MoE settings that depend on which other tokens share the batch, or on randomness per
    token; the router's losses and counts are reweighted (see :mod:`.moe`), these are not."""
    found = []
    if config.moe_expert_capacity_factor is not None:
        found.append(Refused("megatron.moe.capacity_factor",
                             f"moe_expert_capacity_factor={config.moe_expert_capacity_factor}"))
    # megatron-core 0.18+: a per-rank token budget; hybridep drops the tokens past it
    rank_capacity = getattr(config, "moe_expert_rank_capacity_factor", None)
    if rank_capacity is not None:
        found.append(Refused("megatron.moe.rank_capacity_factor",
                             f"moe_expert_rank_capacity_factor={rank_capacity}"))
    balancing = config.moe_router_load_balancing_type
    balancing = balancing if isinstance(balancing, list) else [balancing]
    if "sinkhorn" in balancing:
        found.append(Refused("megatron.moe.sinkhorn", "moe_router_load_balancing_type='sinkhorn'"))
    if "quantile_balancing" in balancing:  # megatron-core 0.19+
        found.append(Refused("megatron.moe.quantile_balancing",
                             "moe_router_load_balancing_type='quantile_balancing'"))
    if training and config.moe_input_jitter_eps is not None:
        found.append(Refused("megatron.moe.input_jitter",
                             f"moe_input_jitter_eps={config.moe_input_jitter_eps}"))
    if config.moe_router_force_load_balancing:
        found.append(Refused("megatron.moe.forced_routing",
                             "moe_router_force_load_balancing=True"))
    force_biased = getattr(config, "moe_router_force_biased", None)  # megatron-core 0.17+
    if force_biased is not None:
        found.append(Refused("megatron.moe.forced_routing",
                             f"moe_router_force_biased={force_biased}"))
    # verl's router_replay patch sets its own enable_routing_replay flag on the config
    replay = config.moe_enable_routing_replay or getattr(config, "enable_routing_replay", False)
    if replay and config.moe_router_fusion:
        found.append(Refused("megatron.moe.replay_router_fusion",
                             "moe_enable_routing_replay with moe_router_fusion=True"))
    return found


def assert_same_plan(plan: SharingPlan, group: torch.distributed.ProcessGroup) -> None:
    """Raises unless every rank of ``group`` (e.g. the pipeline group) holds the same plan.

    Stages exchange only activations, so a stage that planned a different micro-batch would
    silently mix layouts; a mismatch in size is caught by the attention anyway, this catches the
    rest at the cost of one small all-gather.
    """
    digests: list[str | None] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(digests, plan.digest(), group=group)
    if len(set(digests)) != 1:
        raise refuse("megatron.plan_mismatch", f"the ranks' plan digests are {digests}",
                     error=UnsupportedSetupError)
