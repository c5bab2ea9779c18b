"""verl's FSDP engine with prefix sharing on a vision-language checkpoint (verl 0.9.1) gives
verl's own step, on the same weights, with each distinct image encoded once.

verl loads a tiny seeded Qwen2.5-VL and Qwen3-VL (2-block vision tower; Qwen3-VL's deepstack
features from both blocks) through its own ``initialize()``
(monkey patches, gradient checkpointing, FSDP2, optimizer; see ``_fsdp_engine``). The
reference is verl's stock engine with the feature off in its padded layout
(``use_remove_padding=False``): verl's packed VLM step calls flash-attention's varlen kernel
directly, which does not run on CPU. Compared, fp32 within 1e-5: old log-probs and entropy
(``infer_batch``), ``ppo_loss`` and every gradient, the vision tower's included
(``forward_backward_batch``), on batches as verl's legacy trainer lays them out (per-sample
``multi_modal_inputs``, verl's 4-row positions; ``_vlm_batch``). The step's metrics count
images and image tokens; a control whose image identity is switched off (every image hashes
alike) shares two prompts whose tokens agree but whose images differ, and must fail.
"""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import actor_config, build_engine, save_model  # noqa: E402
from tests.verl_ext._vlm_batch import (GRID, WORKLOADS, distinct_prefixes,  # noqa: E402
                                       sample_tags)

FAMILY = "qwen2_5_vl"
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
SHARING = MODES["arbitrary_prefix"]
TOKENS_PER_IMAGE = GRID[0] * GRID[1] // 4
LAYERS = 2  # the tiny preset's decoder layers


def _transformers_has_the_families() -> bool:
    from prefix_sharing.fsdp_compat.vlm import vlm_release_problem

    return vlm_release_problem(FAMILY) is None


def step(engine, data, config) -> dict:
    """``infer_batch`` then ``forward_backward_batch`` with ``ppo_loss``, and every gradient."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.verl_ext.mcore import prompt_lengths
    from tests.verl_ext._batch import plain_output
    from tests.verl_ext._fsdp_engine import count_sharing_attention

    with count_sharing_attention() as calls:
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
    from tests.verl_ext._batch import PRESET, use_cpu_platform
    from tests.verl_ext._vlm_batch import make_vlm_batch

    use_cpu_platform()
    model = build_model(family, PRESET)  # its get_rope_index builds verl's positions
    batches = {name: make_vlm_batch(model, name) for name in WORKLOADS}
    results = {"tags": {name: sample_tags(data, model.config) for name, data in batches.items()}}
    for mode, prefix_grouper, workloads in (
            ("off", None, list(WORKLOADS)), ("shared", SHARING, list(WORKLOADS)),
            ("no_image_identity", SHARING, ["grpo_same_tokens"])):
        packed = prefix_grouper is not None
        config = actor_config(prefix_grouper, remove_padding=packed)
        engine = build_engine(config, path)
        for name in workloads:
            data = batches[name].clone()
            tu.assign_non_tensor(data, use_remove_padding=packed)
            if mode == "no_image_identity":
                with mock.patch("prefix_sharing.fsdp_compat.vision._digest",
                                lambda pixel, grid: b"one image"):
                    results[name, mode] = step(engine, data, config)
            else:
                results[name, mode] = step(engine, data, config)
        results[mode, "engine"] = type(engine).__name__
    return results


@pytest.fixture(scope="module", params=FAMILIES)
def runs(request, tmp_path_factory):
    if not _transformers_has_the_families():
        pytest.skip("the tiny VLM configs need transformers >= 5.10 (verl 0.9.1's)")
    path = save_model(str(tmp_path_factory.mktemp(request.param)), request.param)
    return run_gloo(one_rank, 1, path, request.param, timeout=600)[0]


@pytest.mark.parametrize("workload", ["grpo_images", "multi_turn", "grpo_same_tokens"])
def test_shared_equals_verls_stock_step(runs, workload):
    assert runs["shared", "engine"] == "PrefixSharingFSDPEngine"
    plain = runs[workload, "off"]
    assert any(name.startswith("model.visual.") for name in plain["grads"])  # the tower's too
    same_outputs(runs[workload, "shared"], plain, workload)
    # the text model's layers ran the sharing attention (inference, training, checkpoint replay)
    assert runs[workload, "shared"]["attention_calls"] == 3 * LAYERS
    assert plain["attention_calls"] == 0


@pytest.mark.parametrize("workload, images_total, images_computed", [
    ("grpo_images", 6, 2),  # one micro-batch of 6: each prompt's image once
    ("multi_turn", 5, 3),  # turn 1's screenshot in all 3, each second turn's in one
    ("grpo_same_tokens", 6, 2),
])
def test_the_steps_metrics_count_images_and_tokens(runs, workload, images_total,
                                                   images_computed):
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
    control = runs["grpo_same_tokens", "no_image_identity"]
    assert control["train"]["metrics"]["prefix_sharing/vision_images_computed"] == [1]
    with pytest.raises(AssertionError, match="relative error"):
        same_outputs(control, runs["grpo_same_tokens", "off"], "no image identity")


def refused_on_build(rank: int, path: str, prefix_grouper: dict) -> str:
    from tests.verl_ext._batch import use_cpu_platform

    from prefix_sharing.errors import PrefixSharingSetupError

    use_cpu_platform()
    try:
        build_engine(actor_config(prefix_grouper), path)
    except PrefixSharingSetupError as error:
        return str(error)
    return "built"


def test_the_self_check_and_other_vision_families_are_refused_by_name(tmp_path):
    if not _transformers_has_the_families():
        pytest.skip("the tiny VLM configs need transformers >= 5.10")
    path = save_model(str(tmp_path / "qwen3_5"), "qwen3_5")  # not served by the engine yet
    message = run_gloo(refused_on_build, 1, path, dict(SHARING), timeout=600)[0]
    assert "[verl.multimodal]" in message and "qwen3_5" in message, message
    path = save_model(str(tmp_path / FAMILY), FAMILY)
    message = run_gloo(refused_on_build, 1, path, dict(SHARING, self_check=True), timeout=600)[0]
    assert "[verl.self_check.vlm]" in message, message


def test_an_engine_serving_no_vision_family_and_an_old_transformers_refuse_a_vlm(monkeypatch):
    """The engine check alone (an engine that serves no vision family; verl 0.8.0's
    transformers 4.57 is below the shim's 5.10). The Megatron engine refuses a VLM earlier, at
    construction: test_mcore_vlm.py."""
    from types import SimpleNamespace

    import transformers

    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.mcore import check_engine_setup
    from prefix_sharing.verl_ext.vlm import ENGINE_FAMILIES

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
