"""verl's Megatron engine refuses a vision-language model with sharing on, at construction and by
name (``verl.megatron_vlm``, :mod:`prefix_sharing.verl_ext.mcore_vlm`), before verl imports a
bridge; with sharing off, and for a text model with it on, the same engine is built. Where
mbridge is installed (verl 0.8.0's environment), the blockers the refusal names are pinned on
it, so that a release that removes them fails here and the refusal is revisited."""

import importlib.metadata
import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from prefix_sharing.errors import PrefixSharingSetupError  # noqa: E402
from prefix_sharing.verl_ext.mcore import check_text_only  # noqa: E402

VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # HF configs in transformers 4.57 and 5.x


def build_engines(rank: int) -> dict:
    """One rank (verl's engine constructor reads megatron's parallel state): the registered
    Megatron engine built for each model type (HF's default config, made offline), sharing on
    and off -> ``"built <class>"`` or the error's message."""
    from types import SimpleNamespace

    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (registers it, patched)
    from transformers import AutoConfig

    from prefix_sharing.verl_ext.engine import registered_engine

    from tests.verl_ext._batch import use_cpu_platform
    from tests.verl_ext._compare import MODES
    from tests.verl_ext._engine import actor_config

    use_cpu_platform()
    engine_cls = registered_engine("language_model", "megatron")
    found = {}
    for model_type in (*VISION_FAMILIES, "qwen2"):
        model_config = SimpleNamespace(
            hf_config=AutoConfig.for_model(model_type), model_type="language_model",
            tokenizer=SimpleNamespace(pad_token_id=0),
            mtp=SimpleNamespace(enable=False, enable_train=False))
        for mode in ("arbitrary_prefix", "off"):
            config = actor_config(MODES[mode])
            try:
                engine = engine_cls(model_config, config.engine, config.optim, config.checkpoint)
                found[model_type, mode] = f"built {type(engine).__name__}"
            except PrefixSharingSetupError as error:
                found[model_type, mode] = str(error)
    return found


@pytest.fixture(scope="module")
def built() -> dict:
    return run_distributed(build_engines, 1, timeout=500)[0]


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_a_vlm_is_refused_at_construction_naming_what_blocks_it(built, family):
    message = built[family, "arbitrary_prefix"]
    assert message.startswith("prefix sharing refuses a vision-language model on verl's "
                              f"Megatron engine ({family} has a vision_config)"), message
    assert message.count("[verl.") == 1 and "[verl.megatron_vlm]" in message, message
    for blocker in ("megatron/bridge/peft/lora_layers.py", "rotary_pos_cos_sin",
                    "strategy: fsdp2"):
        assert blocker in message, (blocker, message)


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_same_engine_builds_a_vlm_with_sharing_off_and_a_text_model_with_it_on(built, family):
    """The control: the refusal comes from the vision tower with sharing on, nothing else."""
    assert built[family, "off"] == "built PrefixSharingMegatronEngine", built[family, "off"]
    assert built["qwen2", "arbitrary_prefix"] == "built PrefixSharingMegatronEngine", built


def test_the_forward_names_a_vision_model_and_images_for_a_text_model_apart():
    """The forward's own check (the constructor has refused a vision model before it)."""
    with pytest.raises(PrefixSharingSetupError,
                       match=r"\(vision_model\): .*\[verl\.megatron_vlm\]$"):
        check_text_only(True, {})
    with pytest.raises(PrefixSharingSetupError,
                       match=r"\(multi_modal_inputs\): .*\[verl\.multimodal\]$"):
        check_text_only(False, {"pixel_values": object()})
    check_text_only(False, {})


def mbridge_blockers(rank: int) -> dict:
    """One rank: what mbridge's Qwen2.5-VL meets on this machine (see the refusal's reason)."""
    import inspect

    import torch
    from mbridge import AutoBridge
    from mbridge.models.qwen2_5_vl.attention import Qwen2_5VLSelfAttention
    from megatron.core.transformer.attention import SelfAttention
    from transformers import Qwen2_5_VLConfig

    hf_config = Qwen2_5_VLConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64))
    bridge = AutoBridge.from_config(hf_config, dtype=torch.float32)
    try:
        bridge.get_model(wrap_with_ddp=False, bf16=False)
        get_model = "built"
    except NameError as error:
        get_model = str(error)
    return {"get_model": get_model, "mrope_section": bridge.config.mrope_section,
            "stock": set(inspect.signature(SelfAttention.forward).parameters),
            "mbridge": set(inspect.signature(Qwen2_5VLSelfAttention.forward).parameters)}


@pytest.mark.skipif(
    importlib.util.find_spec("mbridge") is None
    or int(importlib.metadata.version("transformers").split(".")[0]) >= 5,
    reason="verl 0.8.0's environment runs it: mbridge 0.15.1's Qwen2.5-VL bridge reads "
    "rope_scaling['mrope_section'], which transformers 5 (verl 0.9.1's) no longer fills")
def test_mbridge_qwen2_5_vl_still_meets_what_the_refusal_names():
    found = run_distributed(mbridge_blockers, 1, timeout=500)[0]
    assert found["mrope_section"] == [2, 3, 3]  # the config reached mbridge's Qwen2.5-VL
    # megatron-core's TransformerLayer passes rotary_pos_cos_sin; mbridge's attention takes none
    assert "rotary_pos_cos_sin" in found["stock"]
    assert "rotary_pos_cos_sin" not in found["mbridge"], found["mbridge"]
    if importlib.util.find_spec("transformer_engine") is None:  # this machine: no TE
        assert found["get_model"] == "name 'TENorm' is not defined", found["get_model"]
