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

__all__ = ["UnsupportedSetupError", "check_layer_config", "check_sharing_allowed", "assert_same_plan"]


class UnsupportedSetupError(UnsupportedSetup, RuntimeError):
    """A model or parallel setting under which prefix sharing would not give the plain results.

    An :class:`~prefix_sharing.errors.UnsupportedSetup` (bad input: one line in the
    ``prefix-sharing`` command, also from a spawned rank) and, as it always was, a
    ``RuntimeError``.
    """


def check_layer_config(config: TransformerConfig) -> None:
    """Refuses settings the prefix-sharing core attention cannot serve."""
    problems = []
    if config.context_parallel_size > 1:
        problems += _context_parallel_problems(config)
    if getattr(config, "experimental_attention_variant", None) == "dsa":  # megatron-core 0.16+
        problems.append(
            "experimental_attention_variant='dsa': DeepSeek sparse attention (DSA) picks "
            "each query's top-k keys with an indexer over the whole packed sequence, which a "
            "shared prefix's keys would have to be restricted for; use the dense attention"
        )
    mtp_layers = getattr(config, "mtp_num_layers", None)
    if mtp_layers:
        problems.append(
            f"mtp_num_layers={mtp_layers}: multi-token prediction shifts labels and hidden "
            "states along each plain sequence, not along the plan's flat rows; train without "
            "MTP (mtp_num_layers=None) while sharing"
        )
    if getattr(config, "mrope_section", None) is not None:
        problems.append("mrope_section is set: multimodal RoPE positions are not per-token 1-D")
    if config.window_size is not None and config.window_size[1] != 0:
        problems.append(
            f"window_size={config.window_size}: a causal sliding window reads no later keys; "
            f"use window_size=({config.window_size[0]}, 0)"
        )
    virtual_stages = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if virtual_stages is not None and virtual_stages > 1:
        problems.append(
            f"virtual_pipeline_model_parallel_size={virtual_stages}: interleaved pipeline "
            "schedules are not tested with sharing (a first run mislaid a stage's plan); use "
            "virtual_pipeline_model_parallel_size=None"
        )
    if config.apply_rope_fusion:
        problems.append(
            "apply_rope_fusion=True: the fused THD RoPE restarts positions per segment, but a "
            "reuser's tail starts at its prefix length; set apply_rope_fusion=False"
        )
    if problems:
        raise UnsupportedSetupError("prefix sharing does not support " + "; ".join(problems))


def _context_parallel_problems(config: TransformerConfig) -> list[str]:
    """What the context-parallel attention (:mod:`.context_parallel`) and the MoE router's
    context-parallel statistics (:mod:`.moe`) have not been validated with; each is named with
    the setting that turns it off."""
    cp = f"context_parallel_size={config.context_parallel_size} with "
    problems = []
    if config.num_moe_experts and config.calculate_per_token_loss:
        problems.append(
            cp + "num_moe_experts and calculate_per_token_loss=True: the router's z-loss is "
            "weighted per token as at CP=1 for megatron's per-micro-batch loss only; use "
            "calculate_per_token_loss=False"
        )
    return problems


def check_sharing_allowed(config: TransformerConfig, plan: SharingPlan, training: bool) -> None:
    """Refuses settings under which a *shared* prefix would change the results."""
    if not plan.has_sharing:
        return
    problems = []
    if training and config.hidden_dropout > 0:
        problems.append(
            f"hidden_dropout={config.hidden_dropout} in training: every reuser would get its "
            "provider's dropout mask on the shared prefix; set hidden_dropout=0"
        )
    if config.num_moe_experts:
        problems += _moe_problems(config, training)
    if problems:
        raise UnsupportedSetupError("prefix sharing is active but " + "; ".join(problems))


def _moe_problems(config: TransformerConfig, training: bool) -> list[str]:
    """MoE settings that depend on which other tokens share the batch, or on randomness per
    token; the router's losses and counts are reweighted (see :mod:`.moe`), these are not."""
    problems = []
    if config.moe_expert_capacity_factor is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor}: which tokens an "
            "expert drops depends on the other tokens of the batch; use dropless MoE "
            "(moe_expert_capacity_factor=None)"
        )
    # megatron-core 0.18+: a per-rank token budget; hybridep drops the tokens past it
    rank_capacity = getattr(config, "moe_expert_rank_capacity_factor", None)
    if rank_capacity is not None:
        problems.append(
            f"moe_expert_rank_capacity_factor={rank_capacity}: which tokens an expert rank drops "
            "depends on the other tokens of the batch; use moe_expert_rank_capacity_factor=None"
        )
    balancing = config.moe_router_load_balancing_type
    balancing = balancing if isinstance(balancing, list) else [balancing]
    if "sinkhorn" in balancing:
        problems.append(
            "moe_router_load_balancing_type='sinkhorn': Sinkhorn routing normalizes over the "
            "batch's tokens"
        )
    if "quantile_balancing" in balancing:  # megatron-core 0.19+
        problems.append(
            "moe_router_load_balancing_type='quantile_balancing': its routing thresholds are "
            "quantiles over the computed tokens of the batch (and it refuses a padding mask), "
            "so a shared prefix would count once instead of once per reader"
        )
    if training and config.moe_input_jitter_eps is not None:
        problems.append(
            f"moe_input_jitter_eps={config.moe_input_jitter_eps} in training: every reuser "
            "would get its provider's router noise on the shared prefix"
        )
    if config.moe_router_force_load_balancing:
        problems.append(
            "moe_router_force_load_balancing=True: the benchmark's random router logits are "
            "drawn per computed token, so every reuser would get its provider's draw"
        )
    force_biased = getattr(config, "moe_router_force_biased", None)  # megatron-core 0.17+
    if force_biased is not None:
        problems.append(
            f"moe_router_force_biased={force_biased}: the benchmark's random router logits are "
            "drawn per computed token, so every reuser would get its provider's draw"
        )
    # verl's router_replay patch sets its own enable_routing_replay flag on the config
    replay = config.moe_enable_routing_replay or getattr(config, "enable_routing_replay", False)
    if replay and config.moe_router_fusion:
        problems.append(
            "routing replay (moe_enable_routing_replay) with moe_router_fusion=True: the fused "
            "top-k ignores the replayed routes; set moe_router_fusion=False"
        )
    return problems


def assert_same_plan(plan: SharingPlan, group: torch.distributed.ProcessGroup) -> None:
    """Raises unless every rank of ``group`` (e.g. the pipeline group) holds the same plan.

    Stages exchange only activations, so a stage that planned a different micro-batch would
    silently mix layouts; a mismatch in size is caught by the attention anyway, this catches the
    rest at the cost of one small all-gather.
    """
    digests: list[str | None] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(digests, plan.digest(), group=group)
    if len(set(digests)) != 1:
        raise UnsupportedSetupError(
            f"ranks built different sharing plans for the same micro-batch: {digests}; every "
            "stage and tensor-parallel rank must plan the same sequences with the same config"
        )
