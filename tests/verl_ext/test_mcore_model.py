"""What verl's Megatron engine says at construction about the model's build
(``prefix_sharing.verl_ext.mcore_model``): the HF and engine configs read as verl's bridge maps
them, then the sharing layers' own build checks. Per family, on transformers' default configs
(the end-to-end comparison with the model's build: test_preflight.py, test_verl_recipes.py)."""

import importlib.util
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.verl_ext.mcore_model import (  # noqa: E402
    hybrid_pattern,
    model_build_problems,
    transformer_config_view,
)


def model(model_type: str, mtp: bool = False, **fields):
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
    except ValueError:
        pytest.skip(f"this transformers has no {model_type} config")
    return SimpleNamespace(hf_config=hf_config, mtp=SimpleNamespace(enable=mtp))


def engine(cp: int = 1, **overrides):
    return SimpleNamespace(context_parallel_size=cp, override_transformer_config=overrides)


def keys(model_config, engine_config) -> list[str]:
    return [p.key for p in model_build_problems(model_config, engine_config)]


def test_deepseek_v3_is_multi_latent_attention_refused_with_rope_fusion_only():
    deepseek = model("deepseek_v3")
    view = transformer_config_view(deepseek, engine())
    assert view.multi_latent_attention and view.num_moe_experts and not view.apply_rope_fusion
    assert keys(deepseek, engine()) == []
    assert keys(deepseek, engine(apply_rope_fusion=True)) == ["megatron.rope_fusion"]
    assert keys(model("qwen3_moe"), engine(apply_rope_fusion=True)) == []  # GPT attention


def test_deepseek_v4_attention_is_refused_as_sparse_attention():
    assert keys(model("deepseek_v4"), engine()) == ["megatron.dsa"]


def test_mtp_layers_are_served_unless_their_depths_cannot_be_planned():
    """verl builds the checkpoint's MTP layers with model.mtp.enable, and clears them without;
    the layers are served (tests/verl_ext/test_mcore_mtp.py) but under settings the depths'
    plans do not serve, such as one layer repeated for every depth."""
    assert keys(model("qwen2", num_nextn_predict_layers=1), engine()) == []
    assert keys(model("qwen2", mtp=True, num_nextn_predict_layers=1), engine()) == []
    assert keys(model("qwen2", mtp=True, num_nextn_predict_layers=2),
                engine(mtp_use_repeated_layer=True)) == ["megatron.mtp"]
    assert keys(model("qwen2", mtp=True), engine()) == []  # no MTP layer: verl's own error


def test_a_mamba_hybrid_is_refused_by_its_pattern():
    nemotron = model("nemotron_h")
    assert "M" in hybrid_pattern(nemotron.hf_config)
    assert keys(nemotron, engine()) == ["megatron.hybrid_layer"]
    assert hybrid_pattern(model("qwen3").hf_config) is None


def test_a_gated_deltanet_hybrid_under_context_parallelism_is_refused():
    assert keys(model("qwen3_next"), engine(cp=2)) == ["megatron.gdn.context_parallel"]
    assert keys(model("qwen3_next"), engine()) == []


def test_override_transformer_config_wins():
    assert keys(model("qwen2"), engine(window_size=[8, 2])) == [
        "megatron.window_reads_later_keys"]
    assert keys(model("qwen3_moe"), engine(cp=2, calculate_per_token_loss=True)) == [
        "megatron.context_parallel.moe_per_token_loss"]
    assert keys(model("qwen2"), engine(mrope_section=[2, 2, 2])) == ["megatron.mrope"]
