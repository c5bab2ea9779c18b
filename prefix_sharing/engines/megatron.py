"""The Megatron engine: a GPTModel of a preset's shape, run plain and shared on the same weights.

Three ways to compute the same micro-batches, all through megatron's own schedule
(``get_forward_backward_func``, so pipeline parallelism runs exactly as in training):

- ``"shared"``: the prefix-sharing layer spec on the plan's flat layout;
- ``"packed"``: the same model on megatron's stock THD layout (plain ``PackedSeqParams``,
  verl's packing: nothing shared, megatron's own THD RoPE) - what a training step computes
  today, and the baseline ``bench`` times;
- ``"padded"``: megatron's stock local spec on right-padded ``[b, s]`` input, log-probs from
  the gathered full-vocabulary logits one sequence at a time - no code of this package involved,
  the reference ``verify`` checks against.

Weights are seeded by global parameter name, so every tensor-, pipeline- and expert-parallel
layout of a preset holds the same model. Call these inside a rank set up by
:mod:`prefix_sharing.engines.launch`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..config import PrefixSharingConfig
from ..planner import PromptGroup
from ..presets import ModelPreset
from ..equivalence import (
    QUANTITIES,
    Comparison,
    RunOutputs,
    advantages,
    at_least_fp32,
    compare_pairs,
    pg_loss,
    plain_token_log_probs,
    same_keys,
)

__all__ = [
    "LAYOUTS",
    "stock_thd_batch",
    "padded_batch",
    "stock_thd_token_stats",
    "gpt_model",
    "hybrid_model",
    "preset_model",
    "transformer_config",
    "seed_weights",
    "full_grads",
    "MicroBatchRun",
    "forward_backward",
    "compare",
]

LAYOUTS = ("shared", "packed", "padded")


# ----------------------------------------------------------------------------- models
def gpt_model(
    preset: ModelPreset,
    *,
    layout: str = "shared",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layer_spec: Any = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """This rank's stage of a ``preset``-shaped GPTModel with seeded weights.

    Args:
        preset: the model's shape (Llama/Qwen style: RMSNorm, SwiGLU, RoPE, GQA).
        layout: ``"padded"`` builds megatron's stock local spec (two gaps filled for MLA and
            the expert bias: :func:`_padded_reference_spec`), anything else the
            prefix-sharing one.
        dtype: parameter and activation dtype: float32 or bfloat16, or float64 for the
            reference ``verify`` judges a float32 run against (norm weights included).
        seed: weight seed; the same seed gives the same model under every parallel layout.
        layer_spec: a layer ModuleSpec to use instead (e.g. the ``--spec`` object).
        config_overrides: TransformerConfig fields (``qk_layernorm``, ``recompute_*``, ...),
            and GPTModel's ``position_embedding_type`` (``"rope"`` or ``"yarn"``, whose
            ``yarn_*`` settings are set on the config) and ``rotary_percent``.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    rope = _rope_arguments(config_overrides, preset)
    config = transformer_config(preset, dtype, **config_overrides)
    if layer_spec is None:
        layer_spec = _local_spec(preset, config, layout)
    _quiet_gpt_model_deprecation()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=preset.vocab_size,
        max_sequence_length=preset.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=preset.tie_embeddings,
        rotary_base=preset.rotary_base,
        **rope,
    )
    return _placed_and_seeded(model, preset, dtype, seed)


def preset_model(preset: ModelPreset, **kwargs: Any) -> torch.nn.Module:
    """The model a preset describes: its ``HybridModel`` when it names a ``hybrid_pattern``
    (:func:`hybrid_model`), else its ``GPTModel`` (:func:`gpt_model`); same keywords."""
    if preset.hybrid_pattern is not None:
        return hybrid_model(preset, **kwargs)
    return gpt_model(preset, **kwargs)


def transformer_config(preset: ModelPreset, dtype: torch.dtype = torch.float32,
                       **overrides: Any) -> Any:
    """The ``TransformerConfig`` of a ``preset``-shaped model on this rank's parallel layout
    (Llama/Qwen style; the preset's MoE, window and softmax settings); ``overrides`` are
    TransformerConfig fields, and ``yarn_*`` settings the release's config may lack."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        ffn_hidden_size=preset.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=preset.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        # an uneven split (tiny-mla's 3 layers at PP=2): the first stage holds fewer
        num_layers_in_first_pipeline_stage=preset.first_stage_layers(
            parallel_state.get_pipeline_model_parallel_world_size()),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        # the flat layout's length changes from one micro-batch to the next
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
    )
    if preset.num_experts:
        settings.update(_moe_settings(preset))
    if preset.mla is not None:
        settings.update(_mla_settings(preset))
    if preset.window_size is not None:
        settings.update(window_size=(preset.window_size - 1, 0),
                        window_attn_skip_freq=preset.window_full_every)
    if preset.softmax_type != "vanilla":
        settings.update(softmax_type=preset.softmax_type)
    settings.update(_hybrid_settings(preset))
    settings.update(overrides)
    # megatron-core 0.16.1's TransformerConfig has no YaRN fields; GPTModel and the attention
    # read them with getattr, as from Megatron-Bridge's config subclasses
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    extra = {k: settings.pop(k) for k in list(settings) if k.startswith("yarn_") and k not in fields}
    if preset.mla is not None:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config = MLATransformerConfig(**settings)
    else:
        config = TransformerConfig(**settings)
    for name, value in extra.items():
        setattr(config, name, value)
    return config


def _hybrid_settings(preset: ModelPreset) -> dict[str, Any]:
    """A Gated DeltaNet hybrid's settings (Qwen3.5's shape): the GDN heads, head dims and
    convolution width, and its full-attention layers' sigmoid output gate and QK-norm (their
    rotary on a quarter of the head dims: :data:`QWEN35_ROTARY_PERCENT`). Nothing for a GPT
    (megatron-core 0.16.1's config has no ``attention_output_gate``)."""
    if preset.full_attention_every is None:
        return {}
    return dict(linear_num_key_heads=preset.linear_num_key_heads,
                linear_num_value_heads=preset.linear_num_value_heads,
                linear_key_head_dim=preset.linear_head_dim,
                linear_value_head_dim=preset.linear_head_dim,
                linear_conv_kernel_dim=preset.linear_conv_kernel_dim,
                attention_output_gate=True, qk_layernorm=True)


# Qwen3.5 / Qwen3-Next rotate a quarter of each attention head's dims (partial_rotary_factor)
QWEN35_ROTARY_PERCENT = 0.25


def hybrid_model(
    preset: ModelPreset,
    pattern: str | None = None,
    *,
    layout: str = "shared",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    stack_spec: Any = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """This rank's ``HybridModel`` of a ``preset``'s shape, its layers from ``pattern`` (e.g.
    ``"*-*E"``: attention, MLP, attention, MoE; default: the preset's ``hybrid_pattern``),
    seeded weights (megatron-core >= 0.18; Gated DeltaNet layers ``G``: 0.19.2).

    ``layout="padded"`` builds megatron's modules as they are (the local, TE-free hybrid stack
    spec), anything else the prefix-sharing one; ``stack_spec`` a ``HybridStack`` spec to use
    instead; ``config_overrides`` as for :func:`gpt_model`. On a CPU the padded model's GDN
    layers run megatron's own torch path (see :func:`_gdn_on_cpu`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_total_layer_count
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from ..megatron_ext import hybrid

    pattern = preset.hybrid_pattern if pattern is None else pattern
    if pattern is None:
        raise ValueError(f"the preset {preset.name!r} names no hybrid layer pattern; pass one")
    rope = _rope_arguments(config_overrides, preset)
    stock_gdn_on_cpu = layout == "padded" and "G" in pattern and not torch.cuda.is_available()
    if stock_gdn_on_cpu:
        config_overrides.setdefault("deterministic_mode", True)
    config = transformer_config(preset, dtype, num_layers=get_hybrid_total_layer_count(pattern),
                                **config_overrides)
    if stack_spec is None:
        stack_spec = hybrid.get_hybrid_stack_local_spec(normalization=config.normalization,
                                                        qk_layernorm=config.qk_layernorm,
                                                        moe_grouped_gemm=config.moe_grouped_gemm)
        if layout != "padded":
            stack_spec = hybrid.with_prefix_sharing(stack_spec)
    model = HybridModel(
        config=config,
        hybrid_stack_spec=stack_spec,
        vocab_size=preset.vocab_size,
        max_sequence_length=preset.max_sequence_length,
        hybrid_layer_pattern=pattern,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=preset.tie_embeddings,
        rotary_base=preset.rotary_base,
        **rope,
    )
    if stock_gdn_on_cpu:
        _gdn_on_cpu(model, dtype)
    return _placed_and_seeded(model, preset, dtype, seed)


def _local_spec(preset: ModelPreset, config: Any, layout: str) -> Any:
    """megatron's local spec for ``config`` - the stock one for ``layout="padded"`` (with the
    gaps :func:`_padded_reference_spec` fills), else the prefix-sharing one; a block spec
    (one spec per layer) when the preset's first layers are dense and the rest MoE."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)

    from ..megatron_ext import with_prefix_sharing

    if preset.first_dense_layers:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=config.normalization)
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            normalization=config.normalization, qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention)
    if layout != "padded":
        return with_prefix_sharing(spec)
    if config.multi_latent_attention or config.moe_router_enable_expert_bias:
        return _padded_reference_spec(spec, config)
    return spec


def _gdn_on_cpu(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Megatron's stock GDN layers on a CPU: its torch path (``deterministic_mode``: a torch
    ``conv1d`` and megatron's ``torch_chunk_gated_delta_rule``, set by :func:`hybrid_model`; fla's
    Triton kernels need a GPU). That rule computes in float32 whatever its inputs, so a float64
    reference model's GDN layers run the project's torch rule instead, which keeps float64 (it
    is checked against a token-by-token recurrence in ``tests/recurrent``)."""
    from ..recurrent.batch_major import gated_delta_rule_batch_major

    if dtype != torch.float64:
        return
    for module in model.modules():
        if hasattr(module, "gated_delta_rule"):
            module.gated_delta_rule = gated_delta_rule_batch_major


def _rope_arguments(config_overrides: dict[str, Any],
                    preset: ModelPreset | None = None) -> dict[str, Any]:
    """The model constructor's rotary arguments, taken out of ``config_overrides`` (default
    ``rotary_percent``: Qwen3.5's quarter for a Gated DeltaNet hybrid preset, else 1)."""
    rotary_percent = 1.0
    if preset is not None and preset.full_attention_every is not None:
        rotary_percent = QWEN35_ROTARY_PERCENT
    rope = dict(position_embedding_type="rope", rotary_percent=rotary_percent)
    rope.update({k: config_overrides.pop(k) for k in list(rope) if k in config_overrides})
    return rope


def _placed_and_seeded(model: torch.nn.Module, preset: ModelPreset, dtype: torch.dtype,
                       seed: int) -> torch.nn.Module:
    _mark_sinks_split_with_heads(model)
    if dtype == torch.float64:
        model.double()  # megatron's torch norms are built float32 whatever params_dtype says
    if torch.cuda.is_available():
        model.cuda()
    seed_weights(model, seed, preset.init_std)
    return model


def _mark_sinks_split_with_heads(model: torch.nn.Module) -> None:
    """Marks learnable sinks (``softmax_offset``, one per head of this rank) as tensor-parallel
    along dim 0, as the sharing core attention does: megatron-core's stock attention leaves them
    unmarked, and seeding and gathering them would then treat each rank's as the whole."""
    from megatron.core import tensor_parallel

    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset") and not getattr(
            param, "tensor_model_parallel", False
        ):
            tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)


def _quiet_gpt_model_deprecation() -> None:
    """Drops megatron-core 0.19's "GPTModel IS DEPRECATED" warning, logged once per model built
    (verify builds three per rank): GPTModel is what the project's GPT path and its users'
    trainers build, and the warning would bury the command's report."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(f is _drop_gpt_model_deprecation for f in logger.filters):
        logger.addFilter(_drop_gpt_model_deprecation)


def _drop_gpt_model_deprecation(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("GPTModel IS DEPRECATED")


def _moe_settings(preset: ModelPreset) -> dict[str, Any]:
    """A dropless top-k MoE (softmax scores) with the router losses megatron has - the three
    load-balancing losses and the z-loss - so that a run checks them all; experts as
    SequentialMLP (grouped GEMM needs a GPU); the preset's DeepSeek-style additions
    (:func:`_deepseek_moe_settings`). Sequence
    parallelism under tensor parallelism, without which megatron-core refuses to train MoE."""
    from megatron.core import parallel_state

    return dict(
        sequence_parallel=parallel_state.get_tensor_model_parallel_world_size() > 1,
        num_moe_experts=preset.num_experts,
        moe_router_topk=preset.moe_router_topk,
        moe_ffn_hidden_size=preset.moe_ffn_hidden_size,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.1, 0.1, 0.1],
        moe_z_loss_coeff=0.01,
        **_deepseek_moe_settings(preset),
    )


def _deepseek_moe_settings(preset: ModelPreset) -> dict[str, Any]:
    """DeepSeek-V3's MoE additions: a shared expert, sigmoid scores with an expert bias on the
    choice, routed weights scaled, the first layers dense (megatron's ``moe_layer_freq``)."""
    settings: dict[str, Any] = dict(moe_router_score_function=preset.moe_score_function,
                                    moe_router_enable_expert_bias=preset.moe_expert_bias)
    if preset.moe_expert_bias:
        settings.update(moe_router_bias_update_rate=1e-3, moe_router_topk_scaling_factor=2.5)
    if preset.moe_shared_expert_size:
        settings.update(moe_shared_expert_intermediate_size=preset.moe_shared_expert_size)
    if preset.first_dense_layers:
        settings.update(moe_layer_freq=[0] * preset.first_dense_layers
                        + [1] * (preset.num_layers - preset.first_dense_layers))
    return settings


def _mla_settings(preset: ModelPreset) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of the preset's multi-latent attention: plain RoPE on
    the rotary slice (no YaRN unless overridden), DeepSeek's norms on the compressed q and
    kv (megatron's ``qk_layernorm``), one key/value head per query head."""
    mla = preset.mla
    return dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        num_query_groups=preset.num_attention_heads,
        rope_type="rope",
        rotary_base=preset.rotary_base,
        qk_layernorm=True,
    )


def _padded_reference_spec(spec: Any, config: Any) -> Any:
    """The stock spec, two gaps of megatron-core's own filled so the padded reference builds
    and runs on CPU:

    - multi-latent attention's core attention is built with ``k_channels`` / ``v_channels``,
      which only megatron's Transformer Engine attention accepts: here megatron's
      ``DotProductAttention`` told the value head dim (:func:`_mla_dot_product_attention`);
    - with an expert bias, megatron's ``TopKRouter._apply_expert_bias`` masks the
      ``[tokens, experts]`` routing map with the ``[tokens]`` padding mask, which does not
      broadcast (0.16.1 - 0.19.2): here the mask per token (:func:`_padded_router`).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ..megatron_ext.spec_surgery import mlp_with_router, moe_router, replaced

    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    swapped = []
    for layer in layers:
        if config.multi_latent_attention:
            attention = replaced(layer.submodules.self_attention,
                                 core_attention=ModuleSpec(module=_mla_dot_product_attention()))
            layer = replaced(layer, self_attention=attention)
        mlp = layer.submodules.mlp
        router = moe_router(mlp)
        if config.moe_router_enable_expert_bias and router is not None:
            layer = replaced(layer, mlp=mlp_with_router(mlp, _padded_router(router)))
        swapped.append(layer)
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=swapped)
    return swapped[0]


@functools.cache
def _padded_router(router: type) -> type:
    """``router`` (megatron's ``TopKRouter``) counting expert-bias tokens with the padding mask
    per token, as megatron intends (its own line does not broadcast)."""

    class PaddedRouter(router):  # type: ignore[misc, valid-type]
        def _apply_expert_bias(self, routing_map: torch.Tensor,
                               padding_mask: torch.Tensor | None = None) -> None:
            mask = None if padding_mask is None else padding_mask.reshape(-1, 1)
            super()._apply_expert_bias(routing_map, mask)

    return PaddedRouter


@functools.cache
def _mla_dot_product_attention() -> type:
    """Megatron's ``DotProductAttention`` taking MLA's ``k_channels`` / ``v_channels``, with
    the value head dim as its output width per head (its math takes any value width; only
    its output view assumes ``kv_channels``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        # megatron's Attention base class first builds it without the two
        def __init__(self, *args: Any, k_channels: int | None = None,
                     v_channels: int | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def seed_weights(model: torch.nn.Module, seed: int, std: float = 0.05) -> None:
    """Fills every parameter from a generator seeded by its global name and ``seed``.

    The full (TP=1) tensor is drawn, then this rank's shard is cut from it the way megatron
    shards it (``partition_stride`` chunks dealt round-robin), so every layout gets the same
    model. Norm weights near 1, everything else normal with standard deviation ``std`` (the
    preset's ``init_std``); so are MoE routers' expert-bias buffers.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = list(param.shape)
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded:
                shape[param.partition_dim] *= tp_size
            global_name = _global_name(model, name)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
            full = torch.randn(shape, generator=gen)
            is_norm = "norm" in global_name and global_name.endswith("weight")
            full = 1 + 0.1 * full if is_norm else std * full
            if sharded:
                chunks = full.chunk(tp_size * _stride(param), dim=param.partition_dim)
                full = torch.cat(chunks[tp_rank::tp_size], dim=param.partition_dim)
            param.copy_(full)
        for name, buffer in model.named_buffers():
            # an MoE router's expert bias (a buffer, zero when built): random, so that the
            # bias it adds to the expert choice is exercised too
            if name.endswith("router.expert_bias"):
                gen = torch.Generator().manual_seed(
                    seed * 1_000_003 + zlib.crc32(_global_name(model, name).encode()))
                buffer.copy_(std * torch.randn(buffer.shape, generator=gen))


def _stride(param: torch.nn.Parameter) -> int:
    """A tensor-parallel parameter's ``partition_stride``; megatron's GDN marks its
    convolution and gate parameters split along dim 0 without one (stride 1)."""
    return getattr(param, "partition_stride", 1)


def finalize_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sums, in place, the per-rank partial gradients of sequence-parallel parameters (norms,
    the MoE router: each rank saw only its slice of the tokens) over the tensor-parallel group,
    as megatron's ``finalize_model_grads`` does before the optimizer step. Collective."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=group)


def finalize_context_parallel_grads(model: torch.nn.Module) -> None:
    """Averages, in place, every gradient over the context-parallel group, as megatron's
    ``finalize_model_grads`` does (its data-parallel reduction spans data x context parallel).
    Each CP rank back-propagated its own rows' share of a loss that megatron's schedule scaled
    by the CP size, so the average is the whole micro-batch's gradient. Collective."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return
    group = parallel_state.get_context_parallel_group()
    for param in model.parameters():
        if param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=group)
            param.grad.div_(cp_size)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's gradients, tensor-parallel shards gathered to TP=1 shape, by global name
    (experts by their global index, so an expert-parallel rank holds its own experts' only).

    Collective over the tensor-parallel group: every TP rank must call it.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "tensor_model_parallel", False):
            dim, stride = param.partition_dim, _stride(param)
            shards = [torch.empty_like(grad) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, grad, group=group)
            per_shard = [shard.chunk(stride, dim=dim) for shard in shards]
            grad = torch.cat([chunks[s] for s in range(stride) for chunks in per_shard], dim=dim)
        grads[_global_name(model, name)] = grad.cpu()
    return grads


# an expert's local index: SequentialMLP's ``local_experts.<i>.``, TEGroupedMLP's ``weight<i>``
_LOCAL_EXPERT = re.compile(r"(?<=\.experts\.local_experts\.)\d+(?=\.)"
                           r"|(?<=\.experts\.linear_fc[12]\.weight)\d+$"
                           r"|(?<=\.experts\.linear_fc[12]\.bias)\d+$")


def _global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` with its stage- and rank-local numbers made global: ``decoder.layers.<i>`` the
    layer's number in the whole model, an expert's local index ``i`` the global
    ``ep_rank * num_local_experts + i``; so every pipeline- and expert-parallel layout names,
    and seeds, a parameter alike. (Legacy ``GroupedMLP`` holds all local experts in one
    ``weight1`` / ``weight2`` and keeps its name.)"""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    if _LOCAL_EXPERT.search(rest):
        from megatron.core import parallel_state

        ep_size = parallel_state.get_expert_model_parallel_world_size()
        offset = parallel_state.get_expert_model_parallel_rank() * (
            model.config.num_moe_experts // ep_size)
        rest = _LOCAL_EXPERT.sub(lambda m: str(offset + int(m.group())), rest)
    return f"{prefix}{model.decoder.layers[int(local)].layer_number - 1}.{rest}"


# ----------------------------------------------------------------------------- plain THD
def stock_thd_batch(sequences: Sequence[torch.Tensor], device: Any = None,
                    backend: str = "auto") -> tuple[Any, Any]:
    """Megatron's stock THD inputs for a micro-batch, and what its log-probs are read with.

    Returns ``(inputs, stats_batch)``: ``inputs`` is
    :func:`~prefix_sharing.megatron_ext.packed_seq.plain_micro_batch` (plain ``PackedSeqParams``,
    each sequence padded to the tensor-parallel size), ``stats_batch`` a ``MicroBatch`` of the
    nothing-shared plan, whose flat layout is exactly the real tokens ``inputs.token_rows``
    picks: :func:`stock_thd_token_stats` reads the log-probs with the same code as the shared
    step, so the two steps differ only in what sharing changes. ``backend``: the attention
    kernel (the core attention reads a ``backend`` attribute of plain ``PackedSeqParams`` too).
    """
    from ..megatron_ext import prepare_micro_batch
    from ..megatron_ext.packed_seq import plain_micro_batch

    inputs = plain_micro_batch(sequences, device=device)
    inputs.packed_seq_params.backend = backend
    stats_batch = prepare_micro_batch(sequences, PrefixSharingConfig(mode="off"),
                                      pad_to_multiple_of=1, device=device)
    return inputs, stats_batch


def stock_thd_token_stats(logits: torch.Tensor, inputs: Any, stats_batch: Any) -> Any:
    """Per-token log-probs and entropy from the stock THD logits ``[1, T_padded, V_local]``."""
    from ..megatron_ext import token_stats

    if logits.size(1) != inputs.token_rows.numel():  # drop each sequence's pad rows
        logits = logits.index_select(1, inputs.token_rows)
    return token_stats(logits, stats_batch)


# ----------------------------------------------------------------------------- running
@dataclasses.dataclass
class MicroBatchRun:
    """One pass over the micro-batches: per micro-batch packed outputs (last stage only) and
    this stage's gradients (finalized as for the optimizer step, then :func:`full_grads`);
    ``digests`` are the plans' fingerprints (``shared`` only)."""

    outputs: list[RunOutputs]
    grads: dict[str, torch.Tensor]
    digests: list[str]


def forward_backward(
    model: torch.nn.Module,
    batches: Sequence[Sequence[torch.Tensor]],
    layout: str,
    config: PrefixSharingConfig = PrefixSharingConfig(),
    groups: Sequence[Sequence[PromptGroup] | None] | None = None,
    routes: Sequence[Sequence[torch.Tensor]] | None = None,
) -> MicroBatchRun:
    """Forward+backward of every micro-batch through megatron's schedule (see the module doc).

    The loss of a micro-batch is :func:`pg_loss` of its log-probs and entropy with seeded
    per-token :func:`advantages`, so every quantity the comparison reads gets a gradient.

    ``routes``: per micro-batch, the recorded MoE routes to replay (one ``[L_i, moe_layers,
    topk]`` tensor per sequence; the model built with ``moe_enable_routing_replay=True``).
    ``"shared"`` hands them to the plan; ``"padded"`` sets each stock router's replay targets
    to them, laid out as its top-k sees the padded ``[s, b]`` batch (this rank's
    sequence-parallel slice of ``s``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..megatron_ext import check_sharing_model, prepare_micro_batch, token_stats

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    _check_context_parallel_layout(layout)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    groups = list(groups) if groups is not None else [None] * len(batches)
    if routes is not None and layout == "packed":
        raise ValueError("routes are replayed in the 'shared' and 'padded' layouts")
    if layout == "padded":
        inputs = [padded_batch(seqs, device) for seqs in batches]
    elif layout == "packed":
        inputs = [stock_thd_batch(seqs, device, config.backend) for seqs in batches]
    else:
        check_sharing_model(model)
        inputs = [prepare_micro_batch(seqs, config, groups=g, device=device,
                                      routes=None if routes is None else routes[i])
                  for i, (seqs, g) in enumerate(zip(batches, groups))]
    model.zero_grad(set_to_none=True)
    outputs: list[RunOutputs] = []
    order = iter(range(len(batches)))

    def forward_step(data_iterator, model):
        i = next(order)
        seqs, mb = batches[i], next(data_iterator)
        if layout == "padded":  # the mask keeps pads out of MoE router statistics
            if routes is not None:
                _replay_padded(model, routes[i], mb[0].size(1))
            output = model(mb[0], mb[1], None, padding_mask=_stage_padding_mask(model, mb[2]))
        else:
            thd = mb[0] if layout == "packed" else mb
            output = model(thd.input_ids, thd.position_ids, None,
                           packed_seq_params=thd.packed_seq_params)

        def loss_func(logits):
            if layout == "padded":
                packed = _unpad(_gather_vocab(logits), seqs)
                log_probs, entropy = plain_token_log_probs(packed, [s.to(packed.device) for s in seqs])
            elif layout == "packed":
                log_probs, entropy = stock_thd_token_stats(logits, *mb)
                packed = _gather_vocab(logits)[0].index_select(0, mb[0].token_rows)
            else:
                stats = token_stats(logits, mb)
                packed = mb.plan.restore(_gather_context_rows(_gather_vocab(logits)[0], mb))
                log_probs, entropy = stats.log_probs, stats.entropy
            weights = advantages(log_probs.numel(), seed=i).to(log_probs.device)
            loss = pg_loss(log_probs, entropy, weights)
            outputs.append(RunOutputs(at_least_fp32(packed.detach()).cpu(),
                                      log_probs.detach().cpu(),
                                      entropy.detach().cpu(), loss.detach().clone().cpu(), {}))
            return loss, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(inputs), model=[model],
        num_microbatches=len(inputs), seq_length=max(len(s) for b in batches for s in b),
        micro_batch_size=1,
    )
    digests = [mb.plan.digest() for mb in inputs] if layout == "shared" else []
    if routes is not None and layout == "padded":
        for router in _routers_replaying(model):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
    finalize_sequence_parallel_grads(model)  # the parameters' .grad are then the optimizer's
    finalize_context_parallel_grads(model)
    return MicroBatchRun(outputs, full_grads(model), digests)


def compare(candidate: MicroBatchRun, reference: MicroBatchRun) -> Comparison:
    """Largest differences over all micro-batches (outputs) and this stage's gradients.

    Raises (AssertionError) when the runs differ in what they hold - the number of micro-batch
    outputs, parameter names, any shape - or hold nothing: a run that lost a micro-batch's
    outputs must not compare as equal. (An inner pipeline stage holds no outputs in either run;
    its gradients are compared.)
    """
    if len(candidate.outputs) != len(reference.outputs):
        raise AssertionError(f"the runs hold outputs of {len(candidate.outputs)} vs "
                             f"{len(reference.outputs)} micro-batches")
    same_keys(candidate.grads, reference.grads, "gradients")
    pairs = {q: [(getattr(c, q), getattr(r, q)) for c, r in zip(candidate.outputs, reference.outputs)]
             for q in QUANTITIES if q != "grads"}
    pairs["grads"] = [(candidate.grads[k], g) for k, g in reference.grads.items()]
    return compare_pairs(pairs)


def _check_context_parallel_layout(layout: str) -> None:
    """Only the shared layout splits a micro-batch across context-parallel ranks (megatron's
    stock attention refuses CP, and its THD layout would need its own zigzag split)."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1 and layout != "shared":
        from ..megatron_ext import UnsupportedSetupError

        raise UnsupportedSetupError(
            f"context_parallel_size={cp_size} runs the 'shared' layout only; the {layout!r} "
            "reference runs at context_parallel_size=1"
        )


def _gather_context_rows(flat: torch.Tensor, mb: Any) -> torch.Tensor:
    """The whole flat layout's rows from every context-parallel rank's slice (for the record of
    the logits; the loss reads only the local rows)."""
    if mb.cp is None:
        return flat
    from ..megatron_ext.context_parallel import gather_rows

    return gather_rows(flat.detach(), mb.cp)


def padded_batch(seqs: Sequence[torch.Tensor], device: Any) -> tuple[torch.Tensor, ...]:
    """Right-padded ``[b, s]`` tokens, positions and padding mask (True at pads); causal
    attention keeps pads out of reach. ``s`` is the longest sequence rounded up to a multiple
    of the tensor-parallel size, which sequence parallelism splits ``s`` by."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    longest = max(len(s) for s in seqs)
    longest += -longest % tp_size
    tokens = torch.zeros(len(seqs), longest, dtype=torch.long)
    padding = torch.ones(len(seqs), longest, dtype=torch.bool)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = s
        padding[row, : len(s)] = False
    positions = torch.arange(longest).expand(len(seqs), longest)
    return tokens.to(device), positions.to(device), padding.to(device)


def _routers_replaying(model: torch.nn.Module) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules()
            if isinstance(m, TopKRouter) and getattr(m, "router_replay", None) is not None]


def _replay_padded(model: torch.nn.Module, routes: Sequence[torch.Tensor], length: int) -> None:
    """Sets every stock router of this stage to replay ``routes`` (per sequence ``[L_i,
    moe_layers or layers, topk]``, the column as ``route_column`` picks it) on the right-padded
    ``[b, length]`` batch: the router's top-k sees ``[s, b]`` flattened s-major, under sequence
    parallelism this rank's slice of ``s``; pad positions replay experts ``0..topk-1`` (their
    outputs are never read)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from ..megatron_ext.routing_replay import route_column

    routers = _routers_replaying(model)
    if not routers:
        raise ValueError("routes were given but no router of this model replays: build it with "
                         "moe_enable_routing_replay=True")
    _, moe_layers, topk = routes[0].shape
    padded = torch.arange(topk).expand(len(routes), length, moe_layers, topk).clone()
    for row, r in enumerate(routes):
        padded[row, : r.size(0)] = r
    plain = padded.transpose(0, 1)  # [s, b, moe_layers, topk]
    if model.config.sequence_parallel:
        plain = plain.chunk(parallel_state.get_tensor_model_parallel_world_size())[
            parallel_state.get_tensor_model_parallel_rank()]
    for router in routers:
        column = plain[:, :, route_column(model.config, router.layer_number, moe_layers)]
        router.router_replay.set_target_indices(column.reshape(-1, topk).to(router.weight.device))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _stage_padding_mask(model: torch.nn.Module, padding: torch.Tensor) -> torch.Tensor:
    """The ``[b, s]`` padding mask as this stage's MoE layers need it.

    Under sequence parallelism megatron-core's ``GPTModel.forward`` cuts this rank's ``s / TP``
    slice of the mask with the embedding, on the first pipeline stage only; a later stage would
    hand its routers the whole mask for a slice of the tokens. ``HybridModel.forward`` never
    cuts it. So those stages get the slice here.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    cut_by_the_model = isinstance(model, GPTModel) and model.pre_process
    if cut_by_the_model or not model.config.sequence_parallel:
        return padding
    return scatter_to_sequence_parallel_region(padding.transpose(0, 1).contiguous()).transpose(0, 1)


def _unpad(logits: torch.Tensor, seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([logits[row, : len(s)] for row, s in enumerate(seqs)])


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from this tensor-parallel rank's slice (differentiable)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)
