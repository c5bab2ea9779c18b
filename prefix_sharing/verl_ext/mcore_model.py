"""What the sharing layers will refuse when verl's Megatron engine builds the model, said at the
engine's construction (and so by ``prefix-sharing preflight``) from the configs alone.

The sharing layers check the model's ``TransformerConfig`` when they are built
(:func:`prefix_sharing.megatron_ext.checks.layer_config_problems`: DeepSeek sparse attention,
MTP settings the depths' plans do not serve, multimodal RoPE, a window reading later keys, MLA with fused RoPE, MoE per-token
loss under CP), a hybrid stack's pattern (:func:`~prefix_sharing.megatron_ext.checks.hybrid_pattern_problems`:
Mamba layers) and a Gated DeltaNet layer under context parallelism. verl builds that config
later, in ``initialize()``, through a bridge (Megatron-Bridge, or the vanilla mbridge) from the
model's HF config, the engine's parallel sizes and ``override_transformer_config``.
:func:`transformer_config_view` gives the fields those checks read, mapped as the bridges map
them, and :func:`model_build_problems` calls the same check functions on it, so the engine's
construction, ``preflight`` and the model's build say the same.

How each field is read (verl 0.9.1's ``_build_tf_config`` and ``check_mtp_config``):

- ``override_transformer_config`` wins for every field it sets (both bridges apply it last);
- ``context_parallel_size``: the engine config's;
- ``num_moe_experts``: the HF config's expert count (``n_routed_experts``, ``num_experts``,
  ``num_local_experts``);
- ``multi_latent_attention``: an HF config with ``kv_lora_rank`` (DeepSeek-V2/V3, Moonlight);
  ``apply_rope_fusion``: off unless overridden (megatron's default; neither bridge's DeepSeek
  provider turns it on);
- ``experimental_attention_variant``: ``dsa`` for DeepSeek-V3.2, ``dsv4_hybrid`` for
  DeepSeek-V4 (the name verl's engine reads for those models);
- ``mtp_num_layers``: with ``model.mtp.enable``, the HF config's MTP depth
  (``num_nextn_predict_layers`` or ``mtp_num_hidden_layers``, verl's ``_get_mtp_num_layers``);
  without, none (verl clears it); ``mtp_use_repeated_layer`` off unless overridden;
- ``mrope_section``: from the HF (text) config's RoPE parameters;
- the hybrid pattern: a Nemotron-H config's ``hybrid_override_pattern`` (or its
  ``layers_block_type``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..refusals import Refused
from .hybrid import is_gdn_hybrid

__all__ = ["transformer_config_view", "hybrid_pattern", "model_build_problems"]

# HF model type -> megatron's experimental_attention_variant
_ATTENTION_VARIANTS = {"deepseek_v32": "dsa", "deepseek_v4": "dsv4_hybrid"}
# a Nemotron-H config's layers_block_type -> the hybrid pattern's symbols
_BLOCK_SYMBOLS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def transformer_config_view(model_config: Any, engine_config: Any) -> SimpleNamespace:
    """The ``TransformerConfig`` fields the sharing layers' build checks read, as verl's bridge
    would set them for ``model_config`` (verl's ``HFModelConfig``) and ``engine_config`` (its
    ``McoreEngineConfig``); see the module doc."""
    hf = getattr(model_config, "hf_config", None)
    text = getattr(hf, "text_config", None) or hf
    mtp = getattr(model_config, "mtp", None)
    rope = (getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
            or {})
    fields = dict(
        context_parallel_size=getattr(engine_config, "context_parallel_size", 1),
        num_moe_experts=next((n for n in (getattr(text, name, None) for name in (
            "n_routed_experts", "num_experts", "num_local_experts")) if n), None),
        calculate_per_token_loss=False,
        multi_latent_attention=getattr(text, "kv_lora_rank", None) is not None,
        apply_rope_fusion=False,
        experimental_attention_variant=_ATTENTION_VARIANTS.get(getattr(hf, "model_type", None)),
        mtp_num_layers=(_mtp_depth(hf) or None) if getattr(mtp, "enable", False) else None,
        mtp_use_repeated_layer=False,
        mrope_section=rope.get("mrope_section") if hasattr(rope, "get") else None,
        window_size=None,
    )
    overrides = dict(getattr(engine_config, "override_transformer_config", None) or {})
    fields.update({name: overrides[name] for name in fields if name in overrides})
    return SimpleNamespace(**fields)


def _mtp_depth(hf_config: Any) -> int:
    """The model's MTP layers, read where verl's ``_get_mtp_num_layers`` reads them."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
            depth = getattr(config, name, None)
            if depth:
                return depth
    return 0


def hybrid_pattern(hf_config: Any) -> str | None:
    """The hybrid stack pattern a Nemotron-H-style HF config describes, or None."""
    pattern = getattr(hf_config, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        return pattern
    blocks = getattr(hf_config, "layers_block_type", None)
    if isinstance(blocks, (list, tuple)) and "mamba" in blocks:
        return "".join(_BLOCK_SYMBOLS.get(block, "?") for block in blocks)
    return None


def model_build_problems(model_config: Any, engine_config: Any) -> list[Refused]:
    """What building this model with the sharing layer spec will refuse (the module doc), by the
    build's own check functions."""
    from ..megatron_ext.checks import (gdn_context_parallel_problems, hybrid_pattern_problems,
                                       layer_config_problems)

    view = transformer_config_view(model_config, engine_config)
    found = layer_config_problems(view)
    hf = getattr(model_config, "hf_config", None)
    pattern = hybrid_pattern(hf)
    if pattern is not None:
        found += hybrid_pattern_problems(pattern)
    if is_gdn_hybrid(hf):
        found += gdn_context_parallel_problems(view)
    return found
