"""Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) in verl's Megatron engine: refused early where
the installed megatron-core cannot carry their recurrent state.

verl's FSDP engine serves these models through the HuggingFace shim
(:mod:`prefix_sharing.fsdp_compat.gated_deltanet`) on any release. Its Megatron engine builds
megatron's ``GatedDeltaNet`` layers, which the sharing layer spec can replace only on
megatron-core 0.19.2 (0.16.1 and 0.17.1 have no packed path; see
:data:`prefix_sharing.megatron_ext.stock_gdn.GDN_NOT_SERVED`). The spec swap would refuse too,
but only once verl's bridge builds the model; :func:`hybrid_release_problem` refuses at engine
construction, from the model's HF config, with the release that works.
"""

from __future__ import annotations

from typing import Any

from ..refusals import Refused

__all__ = ["HYBRID_MODEL_TYPES", "is_gdn_hybrid", "hybrid_release_problem"]

# HF model types whose decoder holds Gated DeltaNet ("linear_attention") layers
HYBRID_MODEL_TYPES: frozenset[str] = frozenset(
    {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def is_gdn_hybrid(hf_config: Any) -> bool:
    """Whether an HF config (or its ``text_config``) describes Gated DeltaNet layers."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        if config is None:
            continue
        if getattr(config, "model_type", None) in HYBRID_MODEL_TYPES:
            return True
        if "linear_attention" in (getattr(config, "layer_types", None) or ()):
            return True
    return False


def hybrid_release_problem(model_config: Any) -> Refused | None:
    """``verl.gdn_release`` when ``model_config`` (verl's ``HFModelConfig``) is a Gated DeltaNet
    hybrid and this megatron-core has no GDN module sharing can serve; None otherwise."""
    if not is_gdn_hybrid(getattr(model_config, "hf_config", None)):
        return None
    from ..megatron_ext.stock_gdn import serves_gated_delta_net
    from ..megatron_ext.release import installed_release

    if serves_gated_delta_net():
        return None
    model_type = getattr(model_config.hf_config, "model_type", "the model")
    return Refused("verl.gdn_release", f"{model_type} on megatron-core {installed_release()}")

