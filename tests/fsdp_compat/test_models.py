"""Seeded HF models of a preset's shape, and the attention setups the shim refuses."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from prefix_sharing.errors import UnsupportedSetup
from prefix_sharing.fsdp_compat import ATTENTION_FAMILIES, build_model, check_supported, enable_prefix_sharing

from ._models import PRESET


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_the_same_seed_gives_the_same_weights_and_the_preset_shape(family):
    a, b = (build_model(family, PRESET, seed=3) for _ in range(2))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert a.config.num_hidden_layers == PRESET.num_layers
    assert a.config.hidden_size == PRESET.hidden_size
    assert a.model.layers[0].self_attn.head_dim == PRESET.head_dim


def test_different_seeds_give_different_weights():
    a, b = build_model("llama", PRESET, seed=0), build_model("llama", PRESET, seed=1)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        build_model("gpt2", PRESET)


def _stub(**config):
    return SimpleNamespace(config=SimpleNamespace(**config), _supports_attention_backend=True)


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_models_are_refused(model_type):
    with pytest.raises(ValueError, match="alibi"):
        check_supported(_stub(model_type=model_type))


def test_multimodal_models_are_refused():
    with pytest.raises(ValueError, match="multimodal"):
        check_supported(_stub(model_type="qwen2_vl", vision_config={"depth": 2}))


def test_a_vision_language_model_on_an_old_transformers_is_refused(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    model = _stub(model_type="qwen2_5_vl", vision_config={"depth": 2},
                  text_config=SimpleNamespace(model_type="qwen2_5_vl_text"))
    with pytest.raises(UnsupportedSetup, match=r"older than 5.10 \(qwen2_5_vl on transformers "
                       r"4.57.6\).*\[hf.vlm_release\]"):
        check_supported(model)


def test_residual_dropout_is_refused_and_seed_oss_without_it_is_served():
    with pytest.raises(UnsupportedSetup, match=r"residual_dropout=0.1.*\[hf.residual_dropout\]"):
        check_supported(build_model("seed_oss", PRESET, residual_dropout=0.1))
    check_supported(build_model("seed_oss", PRESET))


def test_models_outside_the_attention_interface_are_refused():
    model = _stub(model_type="custom")
    model._supports_attention_backend = False
    with pytest.raises(ValueError, match="AttentionInterface"):
        check_supported(model)


def test_enabling_switches_the_attention_in_place():
    model = build_model("qwen3", PRESET)
    assert enable_prefix_sharing(model) is model
    assert model.config._attn_implementation == "prefix_sharing"


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_the_rotary_base_is_the_presets(family):
    preset = dataclasses.replace(PRESET, rotary_base=1_000_000.0)
    model = build_model(family, preset)
    dims = torch.arange(0, preset.head_dim, 2, dtype=torch.float32) / preset.head_dim
    rotary = model.model.rotary_emb
    if family == "gpt_oss":  # YaRN rescales the frequencies of that base
        assert model.config.rope_parameters["rope_type"] == "yarn"
        assert model.config.rope_parameters["rope_theta"] == 1_000_000.0
        return
    inv_freq = getattr(rotary, "full_attention_inv_freq", None)  # Gemma: the global layers'
    torch.testing.assert_close(rotary.inv_freq if inv_freq is None else inv_freq,
                               1.0 / (1_000_000.0 ** dims))
