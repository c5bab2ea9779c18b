"""The tiny MLA GPTModel's weights in transformers' DeepseekV3, the independent reference.

megatron-core and transformers name and lay out DeepSeek-V3's weights differently; both
implement the same model (q LoRA with its norm, the compressed kv plus one rotary key, per-head
up-projection, MLA's de-interleaved RoPE on the rotary slice, a dense first layer, sigmoid
routing with an expert bias on the choice, normalised and scaled top-k weights, a shared
expert). :func:`to_hf_names` maps megatron's tensors (weights, or their gradients) to
transformers' names, fusing what transformers fuses (each expert's gate and up projection
stacked over experts; megatron's ``linear_fc1`` holds gate then up).
"""

from __future__ import annotations

import re

import torch

from prefix_sharing.presets import ModelPreset

_ATTENTION = {  # megatron MLASelfAttention -> transformers DeepseekV3Attention
    "linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
    "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
    "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj",
}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "output_layer.weight": "lm_head.weight",
        "decoder.final_layernorm.weight": "model.norm.weight"}


def hf_model(preset: ModelPreset, config_overrides: dict) -> torch.nn.Module:
    """transformers' DeepseekV3ForCausalLM of the preset's shape (float64, eager experts)."""
    import transformers

    mla = preset.mla
    config = transformers.DeepseekV3Config(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.ffn_hidden_size,
        moe_intermediate_size=preset.moe_ffn_hidden_size,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_attention_heads,
        n_shared_experts=preset.moe_shared_expert_size // preset.moe_ffn_hidden_size,
        n_routed_experts=preset.num_experts, num_experts_per_tok=preset.moe_router_topk,
        routed_scaling_factor=config_overrides["moe_router_topk_scaling_factor"],
        n_group=1, topk_group=1, first_k_dense_replace=preset.first_dense_layers,
        norm_topk_prob=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_head_dim, qk_rope_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim, rms_norm_eps=1e-5, rope_interleave=True,
        max_position_embeddings=preset.max_sequence_length,
        rope_parameters=dict(rope_type="default", rope_theta=preset.rotary_base),
        tie_word_embeddings=False, attention_dropout=0.0, use_cache=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float64)
    return model.double().eval()


def to_hf_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron's full (TP=1) tensors by global name -> transformers' DeepseekV3 names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        layer, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
        hf = f"model.layers.{layer}."
        if rest == "input_layernorm.weight":
            out[hf + "input_layernorm.weight"] = t
        elif rest == "pre_mlp_layernorm.weight":
            out[hf + "post_attention_layernorm.weight"] = t
        elif rest.startswith("self_attention."):
            module, param = rest.split(".")[1:]
            out[f"{hf}self_attn.{_ATTENTION[module]}.{param}"] = t
        elif rest == "mlp.router.weight":
            out[hf + "mlp.gate.weight"] = t
        elif rest == "mlp.router.expert_bias":
            out[hf + "mlp.gate.e_score_correction_bias"] = t
        elif expert := re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight",
                                    rest):
            experts.setdefault((int(layer), expert.group(2)), {})[int(expert.group(1))] = t
        else:  # the dense MLP and the shared expert: SwiGLU's fc1 holds gate then up
            prefix = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_experts."}[
                rest[: rest.index("linear_fc")]]
            if rest.endswith("linear_fc1.weight"):
                gate, up = t.chunk(2, dim=0)
                out[f"{hf}{prefix}gate_proj.weight"], out[f"{hf}{prefix}up_proj.weight"] = gate, up
            else:
                out[f"{hf}{prefix}down_proj.weight"] = t
    for (layer, fc), by_index in experts.items():
        stacked = torch.stack([by_index[i] for i in range(len(by_index))])
        name = "gate_up_proj" if fc == "linear_fc1" else "down_proj"
        out[f"model.layers.{layer}.mlp.experts.{name}"] = stacked
    return out


def load_megatron_weights(hf: torch.nn.Module, megatron: torch.nn.Module) -> None:
    """Copies a one-rank megatron GPTModel's parameters and expert biases into ``hf``; every
    tensor of ``hf`` must be written (the rotary tables excepted)."""
    tensors = {n: p.detach() for n, p in megatron.named_parameters()}
    tensors.update({n: b for n, b in megatron.named_buffers() if n.endswith("expert_bias")})
    state = to_hf_names(tensors)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary_emb" in n for n in missing), missing
