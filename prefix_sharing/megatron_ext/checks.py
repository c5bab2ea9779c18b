"""Setups where sharing would change the results, refused with the setting that causes it.

Two kinds: *structural* settings the prefix-sharing attention cannot serve at all (checked when
the layer is built), and settings that are harmless on the plain layout but not once a prefix is
shared (checked per micro-batch, only when the plan shares something).

The structural checks a model's configuration answers alone are one function each (the
``*_problems`` functions, :func:`layer_config_problems` for all of them on a layer, and
:func:`hybrid_layer_problem` / :func:`hybrid_pattern_problems` for a hybrid stack's layers),
reading any object with ``TransformerConfig``'s field names: the build path raises from them,
and verl's Megatron engine calls them at construction on the fields its bridge would set
(:mod:`prefix_sharing.verl_ext.mcore_model`), which is what ``prefix-sharing preflight`` reports.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from ..errors import UnsupportedSetup
from ..plan import SharingPlan
from ..refusals import Refused, refuse, refuse_all
from .stock_gdn import GDN_NOT_SERVED, serves_gated_delta_net

__all__ = ["UnsupportedSetupError", "check_layer_config", "check_sharing_allowed", "assert_same_plan",
           "layer_config_problems", "context_parallel_problems", "attention_variant_problems",
           "mtp_problems", "mrope_problems", "window_problems", "rope_fusion_problems",
           "gdn_context_parallel_problems", "hybrid_layer_problem", "hybrid_pattern_problems"]


class UnsupportedSetupError(UnsupportedSetup, RuntimeError):
    """A model or parallel setting under which prefix sharing would not give the plain results.

    An :class:`~prefix_sharing.errors.UnsupportedSetup` (bad input: one line in the
    ``prefix-sharing`` command, also from a spawned rank) and, as it always was, a
    ``RuntimeError``.
    """


def check_layer_config(config: TransformerConfig) -> None:
    """Refuses settings the prefix-sharing core attention cannot serve."""
    found = [*layer_config_problems(config), *_virtual_pipeline_problems(config)]
    if found:
        raise refuse_all(found, error=UnsupportedSetupError)


def _virtual_pipeline_problems(config: TransformerConfig) -> list[Refused]:
    """Interleaved stages are served (each chunk's forward gets its micro-batch's plan in its
    own ``PackedSeqParams``), except where megatron's schedule mixes up what the one neighbour
    of a stage sends: at PP=2 without ``overlap_p2p_comm`` it exchanges the next activation and
    the next gradient with that neighbour in one call, their shapes (variable per planned
    micro-batch) matched in posting order, so a stage can take a gradient for an activation."""
    virtual_stages = config.virtual_pipeline_model_parallel_size
    if (virtual_stages is None or virtual_stages < 2 or config.pipeline_model_parallel_size != 2
            or config.overlap_p2p_comm):
        return []
    return [Refused("megatron.virtual_pipeline.two_stage_p2p",
                    f"virtual_pipeline_model_parallel_size={virtual_stages} at "
                    "pipeline_model_parallel_size=2 with overlap_p2p_comm=False")]


def layer_config_problems(config: Any) -> list[Refused]:
    """What the sharing layers refuse when they are built that the model's configuration says
    alone, one function per condition.

    ``config`` is a ``TransformerConfig`` or any object with its field names: the layers' own
    build calls this (:func:`check_layer_config`), and so does verl's sharing Megatron engine
    at construction, on the fields verl's bridge would give the model
    (:mod:`prefix_sharing.verl_ext.mcore_model`), so ``prefix-sharing preflight`` and the
    model's build cannot disagree.
    """
    return [*context_parallel_problems(config), *attention_variant_problems(config),
            *mtp_problems(config), *mrope_problems(config), *window_problems(config),
            *rope_fusion_problems(config)]


def context_parallel_problems(config: Any) -> list[Refused]:
    """What the context-parallel attention (:mod:`.context_parallel`) and the MoE router's
    context-parallel statistics (:mod:`.moe`) have not been validated with; each is named with
    the setting that turns it off."""
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1 and getattr(config, "num_moe_experts", None) and getattr(
            config, "calculate_per_token_loss", False):
        return [Refused("megatron.context_parallel.moe_per_token_loss",
                        f"context_parallel_size={cp} with num_moe_experts and "
                        "calculate_per_token_loss=True")]
    return []


# experimental attention variants whose keys are picked per query by an indexer: megatron-core's
# DeepSeek sparse attention, and DeepSeek-V4's compressed sparse attention (the variant name
# verl's engine reads for deepseek_v4 models)
SPARSE_ATTENTION_VARIANTS = ("dsa", "dsv4_hybrid")


def attention_variant_problems(config: Any) -> list[Refused]:
    """DeepSeek sparse attention (megatron-core 0.16+'s ``experimental_attention_variant``)."""
    variant = getattr(config, "experimental_attention_variant", None)
    if variant in SPARSE_ATTENTION_VARIANTS:
        return [Refused("megatron.dsa", f"experimental_attention_variant={variant!r}")]
    return []


def mtp_problems(config: Any) -> list[Refused]:
    """Multi-token prediction layers (``mtp_num_layers``, :mod:`.mtp`) where their depths'
    layouts are not planned: with routing replay, one layer repeated for every depth, MuP, or
    megatron's per-token loss under context parallelism (each rank's share of it is rolled
    over the rank's own rows)."""
    if not getattr(config, "mtp_num_layers", None):
        return []
    settings = [f"{name}={getattr(config, name)}" for name, unplanned in (
        ("moe_enable_routing_replay", bool),
        ("calculate_per_token_loss",
         lambda v: v and getattr(config, "context_parallel_size", 1) > 1),
        ("use_mup", bool),
        ("mtp_use_repeated_layer", bool),  # one layer for every depth: planned per layer
    ) if unplanned(getattr(config, name, None))]
    return [Refused("megatron.mtp", f"mtp_num_layers={config.mtp_num_layers} with "
                    + ", ".join(settings))] if settings else []


def mrope_problems(config: Any) -> list[Refused]:
    """Multimodal RoPE (``mrope_section``)."""
    if getattr(config, "mrope_section", None) is not None:
        return [Refused("megatron.mrope", "mrope_section is set")]
    return []


def window_problems(config: Any) -> list[Refused]:
    """A sliding window whose right size reads later keys."""
    window = getattr(config, "window_size", None)
    if window is not None and window[1] != 0:
        return [Refused("megatron.window_reads_later_keys",
                        f"window_size={tuple(window)}; use window_size=({window[0]}, 0)")]
    return []


def rope_fusion_problems(config: Any) -> list[Refused]:
    """Fused RoPE with multi-latent attention. GPT attention keeps the fused kernel:
    PrefixSharingSelfAttention hands it one rotary row per flat token (TE's BSHD format);
    MLA's fused kernels take cu_seqlens."""
    if getattr(config, "apply_rope_fusion", False) and getattr(
            config, "multi_latent_attention", False):
        return [Refused("megatron.rope_fusion",
                        "apply_rope_fusion=True with multi_latent_attention=True")]
    return []


def gdn_context_parallel_problems(config: Any) -> list[Refused]:
    """Gated DeltaNet layers under context parallelism (asked where the model has them: the
    sharing GDN mixer's build, verl's engine for a GDN hybrid)."""
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        return [Refused("megatron.gdn.context_parallel", f"context_parallel_size={cp}")]
    return []


# HybridStack pattern symbols (megatron-core's hybrid_layer_allocation.Symbols) whose layers
# sharing serves; "G" (Gated DeltaNet) on megatron-core 0.19.2 only, "|" separates pipeline
# stages, "/" starts multi-token-prediction depths (refused in a hybrid stack, below)
SERVED_HYBRID_SYMBOLS = frozenset("*-E|")
# ... and why the others are not served
UNSERVED_HYBRID_LAYERS = {
    "M": "Mamba: a reuser's tail must start from its provider's conv and SSM state, but "
         "megatron's Mamba mixer trains through mamba_ssm's fused "
         "mamba_split_conv1d_scan_combined, which starts every packed sequence from zero and "
         "takes no initial state (and mamba_ssm does not run on a CPU)",
    "G": GDN_NOT_SERVED,  # on a release without the 0.19.2 module
    "D": "DeepSeek sparse attention: its indexer and MLA attention get no K/V injection",
    "+": "multi-latent attention: its core attention gets no K/V injection",
    "/": "multi-token prediction in a hybrid stack: its MTP layers are not the sharing ones "
         "(a GPTModel's are: prefix_sharing.megatron_ext.mtp)",
}


def hybrid_layer_problem(symbol: str) -> Refused | None:
    """Why a hybrid stack's layer of pattern ``symbol`` (or of a slot a later megatron-core
    added, named by its field) is not served; None when it is. The sharing stack spec's
    stand-in raises it when such a layer is built (:mod:`.hybrid`)."""
    if symbol in SERVED_HYBRID_SYMBOLS or (symbol == "G" and serves_gated_delta_net()):
        return None
    reason = UNSERVED_HYBRID_LAYERS.get(symbol, f"a HybridStackSubmodules.{symbol} layer")
    return Refused("megatron.hybrid_layer", f"hybrid layer {symbol!r}: {reason}")


def hybrid_pattern_problems(pattern: str) -> list[Refused]:
    """The layers of a hybrid ``pattern`` (e.g. ``"M-M*-E"``) that building the sharing stack
    refuses, as one refusal naming each symbol (``/`` for multi-token-prediction depths)."""
    layers, mtp, _ = pattern.partition("/")
    found = [problem for symbol in dict.fromkeys(layers + mtp)
             if (problem := hybrid_layer_problem(symbol)) is not None]
    if not found:
        return []
    return [Refused("megatron.hybrid_layer", "; ".join(problem.detail for problem in found))]


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
