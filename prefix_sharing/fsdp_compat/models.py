"""HuggingFace causal LMs of a preset's shape with seeded random weights (no download).

The families this shim is tested on: Llama, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and
Qwen3-MoE (top-k routed experts; its load-balancing loss is kept exact by
:func:`prefix_sharing.fsdp_compat.router_aux_loss`). Any other decoder whose attention goes
through ``AttentionInterface`` works the same way, once :func:`check_supported` accepts it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..presets import ModelPreset

__all__ = ["FAMILIES", "hf_config", "build_model", "check_supported"]

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")

# Model types whose attention this shim cannot express: position biases added to the scores
# (alibi) or inputs that are not one token stream (vision/audio towers).
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt", "baichuan", "jais", "falcon"})
_MULTIMODAL_SUBCONFIGS = ("vision_config", "audio_config", "text_config", "speech_config")


def hf_config(family: str, preset: ModelPreset, **overrides: Any) -> Any:
    """The transformers config of ``family`` with ``preset``'s shape.

    Qwen3-MoE takes the preset's experts (``num_experts``, ``moe_router_topk``,
    ``moe_ffn_hidden_size``); a dense preset gets 4 experts of half its MLP width, 2 per token.
    Every layer is sparse.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {', '.join(FAMILIES)}")
    shape = dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.ffn_hidden_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_query_groups,
        max_position_embeddings=preset.max_sequence_length,
        tie_word_embeddings=preset.tie_embeddings,
        rope_theta=preset.rotary_base,  # transformers 5 files it under rope_parameters
        initializer_range=preset.init_std,
        use_cache=False,
    )
    if family == "llama":
        config_cls = transformers.LlamaConfig
        shape.update(attention_bias=preset.add_qkv_bias, head_dim=preset.head_dim)
    elif family == "qwen2":
        config_cls = transformers.Qwen2Config  # q/k/v always carry a bias
    elif family == "qwen3":
        config_cls = transformers.Qwen3Config
        shape.update(head_dim=preset.head_dim, attention_bias=preset.add_qkv_bias)
    else:
        config_cls = transformers.Qwen3MoeConfig
        shape.update(head_dim=preset.head_dim, num_experts=preset.num_experts or 4,
                     num_experts_per_tok=preset.moe_router_topk,
                     moe_intermediate_size=preset.moe_ffn_hidden_size
                     or max(1, preset.ffn_hidden_size // 2),
                     decoder_sparse_step=1, norm_topk_prob=True)
    shape.update(overrides)
    return config_cls(**shape)


def build_model(
    family: str,
    preset: ModelPreset,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> torch.nn.Module:
    """A ``family`` causal LM of ``preset``'s shape, weights drawn from ``seed``.

    The same arguments give the same weights in every process (FSDP ranks build the full
    model, then shard it).
    """
    import transformers

    config = hf_config(family, preset, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.to(dtype)


def check_supported(model: torch.nn.Module) -> None:
    """Refuses, with one clear error, a model whose attention the shim would change.

    Sliding-window layers are refused later, per micro-batch, only when a sequence is longer
    than the window (shorter ones never reach it, so the result is unchanged).
    """
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        raise ValueError(f"{model_type} adds alibi position biases to the attention scores; "
                         "prefix sharing covers rotary-position decoders only")
    if any(getattr(config, name, None) is not None for name in _MULTIMODAL_SUBCONFIGS):
        raise ValueError(f"{model_type} is a multimodal model; prefix sharing covers text-only "
                         "causal LMs (token-id sequences)")
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{model_type} does not route its attention through transformers' "
                         "AttentionInterface, so the sharing attention cannot be installed")
