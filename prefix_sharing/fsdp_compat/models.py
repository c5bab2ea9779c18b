"""HuggingFace causal LMs of a preset's shape with seeded random weights (no download).

The families this shim is tested on: Llama, Mistral, Gemma, Seed-OSS (q/k/v bias, residual
dropout), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm),
Qwen3-MoE (top-k routed experts; its load-balancing loss is kept exact by
:func:`prefix_sharing.fsdp_compat.router_aux_loss`), gpt-oss (alternating sliding-window and
full layers, learned attention sinks, MoE, YaRN RoPE), Gemma 3 and Gemma 4 text models (sliding
local layers, every ``window_full_every``-th layer global), and the Gated DeltaNet hybrids
Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``) and Qwen3-Next (see :mod:`.gated_deltanet`), and
the Mamba-2 hybrid Nemotron-H (``nemotron_h``, see :mod:`.mamba2`), and the vision-language
checkpoints Qwen2.5-VL, Qwen3-VL (dense, MoE) and Qwen3.5 (dense, MoE) with their vision tower
(:data:`VLM_FAMILIES`, see :mod:`.vlm`; other multimodal models are refused). Any other decoder whose
attention goes through ``AttentionInterface`` works the same way, once :func:`check_supported`
accepts it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError, MissingPackageError
from ..presets import ModelPreset
from ..refusals import refuse
from .gated_deltanet import HYBRID_FAMILIES, check_recurrent_layers
from .mamba2 import MAMBA_HYBRID_FAMILIES
from .vlm import TEXT_FAMILY, VLM_FAMILIES, check_release, is_vlm, text_config, vlm_config

__all__ = ["ATTENTION_FAMILIES", "FAMILIES", "HYBRID_FAMILIES", "MAMBA_HYBRID_FAMILIES",
           "VLM_FAMILIES",
           "hf_config", "build_model", "check_supported"]

# families whose token mixing is attention only
ATTENTION_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss",
                                       "gemma3_text", "gemma4_text", "mistral", "gemma",
                                       "seed_oss")
FAMILIES: tuple[str, ...] = (*ATTENTION_FAMILIES, *HYBRID_FAMILIES, *MAMBA_HYBRID_FAMILIES,
                             *VLM_FAMILIES)
# transformers has no SDPA path for these (gpt-oss's sinks): the plain model runs eager
_EAGER_ONLY = frozenset({"gpt_oss"})
# the sliding window of the windowed families when the preset has none
DEFAULT_WINDOW = 8

# Model types whose attention this shim cannot express: position biases added to the scores
# (alibi) or inputs that are not one token stream (vision/audio towers).
_ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt", "baichuan", "jais", "falcon"})
_MULTIMODAL_SUBCONFIGS = ("vision_config", "audio_config", "text_config", "speech_config")


def hf_config(family: str, preset: ModelPreset, **overrides: Any) -> Any:
    """The transformers config of ``family`` with ``preset``'s shape.

    Qwen3-MoE and gpt-oss take the preset's experts (``num_experts``, ``moe_router_topk``,
    ``moe_ffn_hidden_size``); a dense preset gets 4 experts of half its MLP width, 2 per token.
    Every layer is sparse. gpt-oss, Gemma 3 and Gemma 4 take the preset's sliding window
    (:data:`DEFAULT_WINDOW` when it has none) on the layers it makes windowed: gpt-oss
    alternates from the first layer, Gemma makes every ``window_full_every``-th layer global
    (every 2nd by default, so a tiny model holds both kinds).
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from {', '.join(FAMILIES)}")
    if family in VLM_FAMILIES:  # the text family's config inside a vision-language one
        return vlm_config(family, preset, hf_config(TEXT_FAMILY[family], preset), **overrides)
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
    elif family == "mistral":  # Mistral-Nemo's shape: an explicit head_dim, no window
        config_cls = transformers.MistralConfig
        shape.update(head_dim=preset.head_dim, sliding_window=None)
    elif family == "gemma":  # Gemma 1: GeLU MLP, embeddings scaled by sqrt(hidden)
        config_cls = transformers.GemmaConfig
        shape.update(head_dim=preset.head_dim, attention_bias=preset.add_qkv_bias)
    elif family == "seed_oss":  # q/k/v bias, no output bias; training dropouts off
        config_cls = transformers.SeedOssConfig
        shape.update(head_dim=preset.head_dim, attention_bias=True, attention_dropout=0.0,
                     residual_dropout=0.0)
    elif family in HYBRID_FAMILIES:
        config_cls, extra = _hybrid_family(transformers, family, preset)
        shape.update(extra)
        shape.pop("rope_theta")  # these take rope_parameters
        if family == "qwen3_5_moe_text":
            shape.pop("intermediate_size")  # every MLP is sparse
    elif family in MAMBA_HYBRID_FAMILIES:
        if not hasattr(transformers, "NemotronHConfig"):
            raise MissingPackageError(f"nemotron_h needs a transformers release with Nemotron-H "
                                      f"(installed: {transformers.__version__}); pip install -U "
                                      "transformers")
        config_cls, extra = transformers.NemotronHConfig, _mamba_family(preset)
        shape.update(extra)
        for name in ("rope_theta", "num_hidden_layers"):  # no rotary; the pattern sets the depth
            shape.pop(name)
    elif family in ("gpt_oss", "gemma3_text", "gemma4_text"):
        config_cls, extra = _windowed_family(transformers, family, preset)
        shape.update(extra)
        shape.pop("rope_theta")  # these take rope_parameters
    else:
        config_cls = transformers.Qwen3MoeConfig
        shape.update(head_dim=preset.head_dim, num_experts=preset.num_experts or 4,
                     num_experts_per_tok=preset.moe_router_topk,
                     moe_intermediate_size=preset.moe_ffn_hidden_size
                     or max(1, preset.ffn_hidden_size // 2),
                     decoder_sparse_step=1, norm_topk_prob=True)
    shape.update(overrides)
    return config_cls(**shape)


def _windowed_family(transformers: Any, family: str, preset: ModelPreset) -> tuple[Any, dict]:
    window = preset.window_size or DEFAULT_WINDOW
    every = preset.window_full_every or 2
    layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                   for i in range(preset.num_layers)]
    common = dict(head_dim=preset.head_dim, sliding_window=window, layer_types=layer_types,
                  attention_dropout=0.0)
    if family == "gpt_oss":
        # its YaRN RoPE, scaled for a context 4x the one the model "was trained on"
        rope = dict(rope_type="yarn", rope_theta=preset.rotary_base, factor=4.0,
                    beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=preset.max_sequence_length // 4)
        return transformers.GptOssConfig, dict(
            common, num_local_experts=preset.num_experts or 4,
            num_experts_per_tok=preset.moe_router_topk,
            intermediate_size=preset.moe_ffn_hidden_size or max(1, preset.ffn_hidden_size // 2),
            attention_bias=True, rope_parameters=rope)
    rope = {t: dict(rope_type="default", rope_theta=preset.rotary_base if t == "full_attention"
                    else 10_000.0) for t in ("full_attention", "sliding_attention")}
    if family == "gemma3_text":
        return transformers.Gemma3TextConfig, dict(
            common, query_pre_attn_scalar=preset.head_dim, rope_parameters=rope,
            attention_bias=preset.add_qkv_bias)
    if not hasattr(transformers, "Gemma4TextConfig"):
        raise MissingPackageError(f"gemma4_text needs a transformers release with Gemma 4 "
                                  f"(installed: {transformers.__version__}); pip install -U "
                                  "transformers")
    return transformers.Gemma4TextConfig, dict(
        common, rope_parameters=rope, attention_bias=preset.add_qkv_bias,
        # Gemma 4's per-layer token embeddings, sized down with the rest of the tiny shape
        vocab_size_per_layer_input=preset.vocab_size, hidden_size_per_layer_input=16,
        global_head_dim=preset.head_dim, num_global_key_value_heads=preset.num_query_groups)


def _hybrid_family(transformers: Any, family: str, preset: ModelPreset) -> tuple[Any, dict]:
    """Qwen3.5 (dense, MoE) and Qwen3-Next: Gated DeltaNet layers with every
    ``full_attention_every``-th layer (4 when the preset says nothing, as the real models) gated
    full attention; rotary on a quarter of the head dim, q/k RMSNorm, output gate."""
    every = preset.full_attention_every or 4
    layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                   for i in range(preset.num_layers)]
    extra = dict(
        head_dim=preset.head_dim, layer_types=layer_types, attention_dropout=0.0,
        attention_bias=preset.add_qkv_bias,
        rope_parameters=dict(rope_type="default", rope_theta=preset.rotary_base,
                             partial_rotary_factor=0.25),
        linear_num_key_heads=preset.linear_num_key_heads,
        linear_num_value_heads=preset.linear_num_value_heads,
        linear_key_head_dim=preset.linear_head_dim, linear_value_head_dim=preset.linear_head_dim,
        linear_conv_kernel_dim=preset.linear_conv_kernel_dim)
    if family == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig, extra
    moe_width = preset.moe_ffn_hidden_size or max(1, preset.ffn_hidden_size // 2)
    extra.update(num_experts=preset.num_experts or 4, num_experts_per_tok=preset.moe_router_topk,
                 moe_intermediate_size=moe_width, shared_expert_intermediate_size=moe_width)
    if family == "qwen3_next":
        extra.update(decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
        return transformers.Qwen3NextConfig, extra
    return transformers.Qwen3_5MoeTextConfig, extra


def _mamba_family(preset: ModelPreset) -> dict:
    """Nemotron-H: one layer per letter of the preset's pattern (``M`` Mamba-2, ``*``
    attention, ``-`` MLP, ``E`` MoE: top-k sigmoid-routed experts and a shared expert)."""
    mamba = preset.mamba
    if mamba is None or len(mamba.pattern) != preset.num_layers:
        raise InputError(f"nemotron_h needs a preset with a Mamba-2 layer pattern of num_layers "
                         f"({preset.num_layers}) letters; {preset.name} has "
                         f"{None if mamba is None else mamba.pattern!r}")
    width = preset.moe_ffn_hidden_size or max(1, preset.ffn_hidden_size // 2)
    return dict(
        hybrid_override_pattern=mamba.pattern, head_dim=preset.head_dim,
        attention_bias=preset.add_qkv_bias, mamba_num_heads=mamba.num_heads,
        mamba_head_dim=mamba.head_dim, ssm_state_size=mamba.state_size, n_groups=mamba.n_groups,
        conv_kernel=mamba.conv_kernel, n_routed_experts=preset.num_experts or 4,
        num_experts_per_tok=preset.moe_router_topk, moe_intermediate_size=width,
        moe_shared_expert_intermediate_size=preset.moe_shared_expert_size or width,
        n_group=1, topk_group=1)


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
    if family in _EAGER_ONLY and attn_implementation == "sdpa":
        attn_implementation = "eager"
    auto = (transformers.AutoModelForImageTextToText if family in VLM_FAMILIES
            else transformers.AutoModelForCausalLM)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.to(dtype)


def check_supported(model: torch.nn.Module) -> None:
    """Refuses, with one clear error, a model whose attention the shim would change.

    Sliding-window layers and learned sinks are served (see
    :func:`~prefix_sharing.fsdp_compat.attention.prefix_sharing_attention`), the Gated
    DeltaNet layers of :data:`HYBRID_FAMILIES` and the Mamba-2 mixers of
    :data:`MAMBA_HYBRID_FAMILIES`, and the language model of the :data:`VLM_FAMILIES`;
    attention logit soft-capping, bidirectional attention, residual dropout (Seed-OSS's
    ``residual_dropout``), other recurrent layers, MTP modules and other multimodal models are
    refused.
    """
    model_type = getattr(model.config, "model_type", type(model).__name__)
    config = text_config(model.config)  # a VLM's language model; its vision tower stays stock
    if model_type in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        raise refuse("hf.alibi", f"{model_type} adds alibi position biases to the attention "
                     "scores")
    if is_vlm(model):
        check_release(model_type)
    elif any(getattr(config, name, None) is not None for name in _MULTIMODAL_SUBCONFIGS):
        raise refuse("hf.multimodal", f"{model_type} is a multimodal model")
    if getattr(config, "residual_dropout", 0.0):
        raise refuse("hf.residual_dropout", f"{model_type} drops out its layer outputs "
                     f"(residual_dropout={config.residual_dropout})")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise refuse("hf.softcapping", f"{model_type} soft-caps its attention logits "
                     f"(attn_logit_softcapping={config.attn_logit_softcapping})")
    if getattr(config, "use_bidirectional_attention", None):
        raise refuse("hf.bidirectional", f"{model_type} attends bidirectionally "
                     f"(use_bidirectional_attention={config.use_bidirectional_attention!r})")
    # the hybrids' attention layers call AttentionInterface though the model does not say so
    if not getattr(model, "_supports_attention_backend", False) and getattr(
            config, "model_type", model_type) not in (
            *HYBRID_FAMILIES, *MAMBA_HYBRID_FAMILIES):
        raise refuse("hf.attention_interface",
                     f"{model_type} does not route its attention through AttentionInterface")

    check_recurrent_layers(model)
