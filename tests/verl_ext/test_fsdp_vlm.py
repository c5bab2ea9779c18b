"""verl's FSDP engine with prefix sharing on a vision-language checkpoint (verl 0.9.1) gives
verl's own step, on the same weights, with each distinct image encoded once.

verl loads a tiny seeded checkpoint of each family it trains with a vision tower - Qwen2.5-VL,
Qwen3-VL (deepstack features from both blocks), Qwen3-VL-MoE, and Qwen3.5 dense and MoE, which
verl loads as ``Qwen3_5(Moe)ForConditionalGeneration`` with their vision tower even for
text-only recipes (one Gated DeltaNet layer, one gated attention layer) - through its own
``initialize()`` (monkey patches, gradient checkpointing, FSDP2, optimizer; see
``_fsdp_engine``). The reference is verl's stock engine with the feature off in its padded
layout (``use_remove_padding=False``): verl's packed VLM step calls flash-attention's varlen
kernel directly, which does not run on CPU. Compared within 1e-5: old log-probs and entropy
(``infer_batch``), ``ppo_loss`` and every gradient, the vision tower's included
(``forward_backward_batch``), on batches as verl's legacy trainer lays them out (per-sample
``multi_modal_inputs``, verl's 4-row positions; ``_vlm_batch``), with images and text-only
(verl's forwards encode a blank image then: its tower's gradients are zeros). fp32, except
Qwen3.5 in float64 (``_fsdp_engine.verl_float64``): the fp32 rule cannot hold for a Gated
DeltaNet's decay gradients even between two plain runs (``test_fsdp_hybrid``). The step's
metrics count images and image tokens; a control whose image identity is switched off (every
image hashes alike) shares two prompts whose tokens agree but whose images differ, and must
fail; one without the blank image leaves the tower out of a text-only step, and must fail.
"""

import dataclasses
import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from prefix_sharing.verl_ext.vlm import ENGINE_FAMILIES, UNSERVED_FAMILIES  # noqa: E402
from tests.verl_ext._batch import PRESET  # noqa: E402
from tests.verl_ext._fsdp_engine import actor_config, build_engine, save_model  # noqa: E402
from tests.verl_ext._vlm_batch import (GRID, WORKLOADS, distinct_prefixes,  # noqa: E402
                                       sample_tags)

FAMILY = "qwen2_5_vl"
# family -> precision; Qwen3.5's tiny checkpoints: a GDN layer, then a gated attention layer
FAMILIES = {"qwen2_5_vl": "fp32", "qwen3_vl": "fp32", "qwen3_vl_moe": "fp32",
            "qwen3_5": "fp64", "qwen3_5_moe": "fp64"}
SHARING = MODES["arbitrary_prefix"]
TOKENS_PER_IMAGE = GRID[0] * GRID[1] // 4


VLM_PRESET = dataclasses.replace(PRESET, full_attention_every=2)  # read by Qwen3.5 only
# verl 0.9.1's own Qwen2.5-VL forward fails on a text-only micro-batch on transformers 5.10
# (its blank-image pass calls .mean() on the tower's output object): no reference to compare to
STOCK_FAILS = {("qwen2_5_vl", "text_only")}


def family_workloads(family: str) -> list[str]:
    return [name for name in WORKLOADS if (family, name) not in STOCK_FAILS]


def attention_layers(family: str) -> int:
    """Decoder layers that run attention (the tiny preset's two; Qwen3.5's second)."""
    return 1 if family.startswith("qwen3_5") else VLM_PRESET.num_layers


def _transformers_has_the_families() -> bool:
    from prefix_sharing.fsdp_compat.vlm import vlm_release_problem

    return vlm_release_problem(FAMILY) is None


def step(engine, data, config) -> dict:
    """``infer_batch`` then ``forward_backward_batch`` with ``ppo_loss``, and every gradient
    (a Gated DeltaNet's plain step with its float64 recurrence at float64)."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.fsdp_compat.plain_kernels import plain_gdn_kernel
    from prefix_sharing.verl_ext.mcore import prompt_lengths
    from tests.verl_ext._batch import plain_output
    from tests.verl_ext._fsdp_engine import count_sharing_attention

    with count_sharing_attention() as calls, plain_gdn_kernel(engine.module):
        with engine.eval_mode():
            infer = engine.infer_batch(data.clone())
        with engine.train_mode():  # zeroes the gradients on exit: gather them before
            train = engine.forward_backward_batch(data.clone(), partial(ppo_loss, config=config))
            grads = full_gradients(engine.module)
    return {"infer": plain_output(infer), "train": plain_output(train), "grads": grads,
            "attention_calls": calls["n"],  # the sharing head scores verl's read window only
            "read_from": [n - 1 for n in prompt_lengths(data)]}


def one_rank(rank: int, path: str, family: str) -> dict:
    """The feature off (padded), then on, then on without image identity, one engine each (verl
    patches Qwen2.5-VL's attention class-wide when a packed engine is built: stock first)."""
    from unittest import mock

    from verl.utils import tensordict_utils as tu

    from prefix_sharing.fsdp_compat import build_model
    from tests.verl_ext._batch import use_cpu_platform
    from tests.verl_ext._fsdp_engine import FP32, FP64, verl_float64
    from tests.verl_ext._vlm_batch import make_vlm_batch

    use_cpu_platform()
    model = build_model(family, VLM_PRESET)  # its get_rope_index builds verl's positions
    batches = {name: make_vlm_batch(model, name) for name in WORKLOADS}
    results = {"tags": {name: sample_tags(data, model.config) for name, data in batches.items()}}
    precision = FAMILIES[family]
    model_fields = {}
    if precision == "fp64":  # transformers' grouped_mm experts have no float64 kernel
        model_fields["override_config"] = {"attn_implementation": "sdpa",
                                           "_experts_implementation": "eager"}
    served = family_workloads(family)
    controls = ["grpo_same_tokens"] + [name for name in ("text_only",) if name in served]
    for mode, prefix_grouper, workloads in (
            ("off", None, served), ("shared", SHARING, served), ("controls", SHARING, controls)):
        packed = prefix_grouper is not None
        config = actor_config(prefix_grouper, remove_padding=packed, model_dtype=precision,
                              mixed_precision={"fp32": FP32, "fp64": FP64}[precision])
        with verl_float64():
            engine = build_engine(config, path, **model_fields)
        for name in workloads:
            data = batches[name].clone()
            tu.assign_non_tensor(data, use_remove_padding=packed)
            if mode == "controls" and name == "grpo_same_tokens":
                with mock.patch("prefix_sharing.fsdp_compat.vision._digest",
                                lambda pixel, grid: b"one image"):
                    results[name, "no_image_identity"] = step(engine, data, config)
            elif mode == "controls":  # no blank image for a text-only micro-batch
                with mock.patch("prefix_sharing.verl_ext.fsdp.blank_image_kwargs",
                                lambda *args: {}):
                    results[name, "no_blank_image"] = step(engine, data, config)
            else:
                results[name, mode] = step(engine, data, config)
            results[mode, "engine"] = type(engine).__name__
    return results


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request, tmp_path_factory):
    if not _transformers_has_the_families():
        pytest.skip("the tiny VLM configs need transformers >= 5.10 (verl 0.9.1's)")
    family = request.param
    path = save_model(str(tmp_path_factory.mktemp(family)), family, preset=VLM_PRESET)
    return family, run_gloo(one_rank, 1, path, family, timeout=600)[0]


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_shared_equals_verls_stock_step(runs, workload):
    family, runs = runs
    if (family, workload) in STOCK_FAILS:
        pytest.skip(f"verl's stock {family} step fails on {workload} (STOCK_FAILS)")
    assert runs["shared", "engine"] == "PrefixSharingFSDPEngine"
    plain = runs[workload, "off"]
    assert any(name.startswith("model.visual.") for name in plain["grads"])  # the tower's too
    same_outputs(runs[workload, "shared"], plain, f"{family} {workload}")
    # the text model's layers ran the sharing attention (inference, training, checkpoint replay)
    assert runs[workload, "shared"]["attention_calls"] == 3 * attention_layers(family)
    assert plain["attention_calls"] == 0


@pytest.mark.parametrize("workload, images_total, images_computed", [
    ("grpo_images", 6, 2),  # one micro-batch of 6: each prompt's image once
    ("multi_turn", 5, 3),  # turn 1's screenshot in all 3, each second turn's in one
    ("grpo_same_tokens", 6, 2),
])
def test_the_steps_metrics_count_images_and_tokens(runs, workload, images_total,
                                                   images_computed):
    _, runs = runs
    metrics = runs[workload, "shared"]["train"]["metrics"]
    tags = runs["tags"][workload]
    assert metrics["prefix_sharing/vision_images_total"] == [images_total]
    assert metrics["prefix_sharing/vision_images_computed"] == [images_computed]
    assert metrics["prefix_sharing/vision_tokens_total"] == [images_total * TOKENS_PER_IMAGE]
    assert metrics["prefix_sharing/vision_tokens_computed"] == [
        images_computed * TOKENS_PER_IMAGE]
    assert metrics["prefix_sharing/tokens_total"] == [sum(map(len, tags))]
    assert metrics["prefix_sharing/tokens_computed"] == [distinct_prefixes(tags)]
    plain = runs[workload, "off"]["train"]["metrics"]
    assert not any(key.startswith("prefix_sharing/") for key in plain)


def test_a_control_without_image_identity_shares_different_images_and_fails(runs):
    _, runs = runs
    control = runs["grpo_same_tokens", "no_image_identity"]
    assert control["train"]["metrics"]["prefix_sharing/vision_images_computed"] == [1]
    with pytest.raises(AssertionError, match="relative error"):
        same_outputs(control, runs["grpo_same_tokens", "off"], "no image identity")


def test_a_control_without_the_blank_image_leaves_the_tower_out_and_fails(runs):
    family, runs = runs
    if (family, "text_only") in STOCK_FAILS:
        pytest.skip(f"verl's stock {family} step fails on text_only (STOCK_FAILS)")
    with pytest.raises(AssertionError, match="parameter names differ"):
        same_outputs(runs["text_only", "no_blank_image"], runs["text_only", "off"],
                     "no blank image")


def refused_on_build(rank: int, path: str, prefix_grouper: dict) -> str:
    from tests.verl_ext._batch import use_cpu_platform

    from prefix_sharing.errors import PrefixSharingSetupError

    use_cpu_platform()
    try:
        build_engine(actor_config(prefix_grouper), path)
    except PrefixSharingSetupError as error:
        return str(error)
    return "built"


def tiny_glm4v_config(directory: str) -> str:
    """A tiny GLM-4.1V config (``Glm4vConfig``; the engine refuses it before loading weights)."""
    import transformers

    text = dict(vocab_size=PRESET.vocab_size, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=2, spatial_merge_size=2)
    config = transformers.Glm4vConfig(text_config=text, vision_config=vision,
                                      architectures=["Glm4vForConditionalGeneration"])
    config.save_pretrained(directory)
    return directory


def test_the_self_check_and_other_vision_families_are_refused_by_name(tmp_path):
    if not _transformers_has_the_families():
        pytest.skip("the tiny VLM configs need transformers >= 5.10")
    path = tiny_glm4v_config(str(tmp_path / "glm4v"))  # GLM-4.1V: a recipe family not served
    message = run_gloo(refused_on_build, 1, path, dict(SHARING), timeout=600)[0]
    assert "[verl.multimodal]" in message and "glm4v" in message, message
    assert UNSERVED_FAMILIES["glm4v"] in message, message
    path = save_model(str(tmp_path / FAMILY), FAMILY)
    message = run_gloo(refused_on_build, 1, path, dict(SHARING, self_check=True), timeout=600)[0]
    assert "[verl.self_check.vlm]" in message, message


@pytest.mark.parametrize("model_type", list(UNSERVED_FAMILIES))
def test_the_recipe_families_the_engine_does_not_serve_are_refused_with_their_reason(
        model_type):
    from types import SimpleNamespace

    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.mcore import check_engine_setup

    model = SimpleNamespace(model_type="language_model",
                            hf_config=SimpleNamespace(vision_config={}, model_type=model_type))
    with pytest.raises(PrefixSharingSetupError, match=r"\[verl\.multimodal\]") as error:
        check_engine_setup(SimpleNamespace(), model, vision_families=ENGINE_FAMILIES)
    assert UNSERVED_FAMILIES[model_type] in str(error.value)


def test_an_engine_serving_no_vision_family_and_an_old_transformers_refuse_a_vlm(monkeypatch):
    """The engine check alone (an engine that serves no vision family; verl 0.8.0's
    transformers 4.57 is below the shim's 5.10). The Megatron engine refuses a VLM earlier, at
    construction: test_mcore_vlm.py."""
    from types import SimpleNamespace

    import transformers

    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.mcore import check_engine_setup

    model = SimpleNamespace(model_type="language_model",
                            hf_config=SimpleNamespace(vision_config={}, model_type=FAMILY))
    with pytest.raises(PrefixSharingSetupError, match=r"\[verl\.multimodal\]"):
        check_engine_setup(SimpleNamespace(), model)
    monkeypatch.setattr(transformers, "__version__", "5.10.0")
    check_engine_setup(SimpleNamespace(), model, vision_families=ENGINE_FAMILIES)
    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(PrefixSharingSetupError, match=r"\[hf\.vlm_release\]"):
        check_engine_setup(SimpleNamespace(), model, vision_families=ENGINE_FAMILIES)


if __name__ == "__main__":  # the figures of docs/results/vlm_fsdp_engine.json
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        result = run_gloo(one_rank, 1, save_model(directory, FAMILY), FAMILY, timeout=600)[0]
    print(json.dumps({name: {k: v[0] for k, v in result[name, "shared"]["train"]["metrics"]
                             .items() if k.startswith("prefix_sharing/")}
                      for name in ("grpo_images", "multi_turn")}, indent=1))
