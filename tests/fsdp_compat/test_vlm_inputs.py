"""Bad vision-language input: one clear error each, before the model runs."""

from __future__ import annotations

import pytest
import torch
import transformers

from prefix_sharing.errors import InputError, UnsupportedSetup
from prefix_sharing.fsdp_compat import shared_forward
from prefix_sharing.fsdp_compat.mrope import flat_positions
from prefix_sharing.fsdp_compat.vlm import MIN_TRANSFORMERS
from prefix_sharing.planner import build_plan

from ._models import EVERY_PREFIX, plain_and_shared
from ._vlm import Batch, vlm_models
from .test_vlm import grpo_image_batch, two_groups

if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
    pytest.skip(f"vision-language models need transformers >= {MIN_TRANSFORMERS} (their "
                "refusal below it: test_models.py)", allow_module_level=True)


@pytest.fixture(scope="module")
def shared():
    return vlm_models("qwen2_5_vl")[1]


def _run(model, batch, **kwargs):
    return shared_forward(model, batch.sequences, EVERY_PREFIX, multi_modal_inputs=batch.mm,
                          **kwargs)


def test_a_placeholder_count_that_does_not_match_the_grid(shared):
    batch = grpo_image_batch(shared.config)
    batch.mm[1] = {**batch.mm[1], "image_grid_thw": torch.tensor([[1, 2, 8]])}  # 16 patches, 4
    batch.sequences[1] = torch.cat([batch.sequences[1][:7], batch.sequences[1][8:]])  # 3 tokens
    with pytest.raises(InputError, match=r"sequence 1: its image placeholder runs hold \[3\]"):
        _run(shared, batch)


def test_patches_that_do_not_fill_the_grid(shared):
    batch = grpo_image_batch(shared.config)
    batch.mm[0] = {**batch.mm[0], "image_grid_thw": torch.tensor([[1, 4, 8]])}
    with pytest.raises(InputError, match="pixel_values has 16 patches but image_grid_thw"):
        _run(shared, batch)


def test_pixel_values_without_their_grid(shared):
    batch = grpo_image_batch(shared.config)
    batch.mm[2] = {"pixel_values": batch.mm[2]["pixel_values"]}
    with pytest.raises(InputError, match="sequence 2 has pixel_values but no image_grid_thw"):
        _run(shared, batch)


def test_placeholders_without_images(shared):
    batch = grpo_image_batch(shared.config)
    batch.mm[3] = None
    with pytest.raises(InputError, match="sequence 3 holds 4 image placeholder tokens"):
        _run(shared, batch)
    batch.mm = None  # a "text-only" call on sequences that hold placeholders
    with pytest.raises(InputError, match="sequence 0 holds 4 image placeholder tokens"):
        _run(shared, batch)


def test_one_entry_per_sequence(shared):
    batch = grpo_image_batch(shared.config)
    batch.mm = batch.mm[:2]
    with pytest.raises(InputError, match=r"one entry \(a dict or None\) per sequence \(4\)"):
        _run(shared, batch)


def test_video_is_refused(shared):
    batch = grpo_image_batch(shared.config)
    batch.mm[0] = {**batch.mm[0], "video_grid_thw": torch.tensor([[2, 4, 4]])}
    with pytest.raises(UnsupportedSetup, match=r"refuses video inputs \(sequence 0's "
                       r"multi_modal_inputs hold video_grid_thw\).*\[hf.video\]"):
        _run(shared, batch)
    batch = grpo_image_batch(shared.config)
    batch.sequences[0][0] = shared.config.video_token_id
    with pytest.raises(UnsupportedSetup, match=r"\(sequence 0 holds video placeholder tokens.*"
                       r"\[hf.video\]"):
        _run(shared, batch)


def test_a_plan_that_shares_across_different_images_is_refused(shared):
    batch, _ = two_groups(shared.config)
    tokens_only = build_plan(batch.sequences, EVERY_PREFIX)
    with pytest.raises(InputError, match="shares a prefix of sequence . across different images"):
        _run(shared, batch, plan=tokens_only)


def test_shared_prefixes_whose_positions_disagree_are_refused():
    plan = build_plan([torch.arange(6), torch.arange(6)], EVERY_PREFIX)  # a duplicate
    ramp = torch.arange(6)[None].repeat(3, 1)
    assert torch.equal(flat_positions(plan, [ramp, ramp]), ramp)
    other = ramp.clone()
    other[1:, 3:] += 2  # the second sample's rows jump as after an image
    with pytest.raises(InputError, match=r"sequence 0's mrope positions differ from those of a sequence sharing its prefix \(at token 3\)"):
        flat_positions(plan, [ramp, other])


def test_images_for_a_text_model_are_refused():
    _, text_model = plain_and_shared("qwen2")
    batch = Batch(text_model.config)
    batch.sequences, batch.mm = [torch.arange(5)], [{"pixel_values": torch.zeros(4, 24)}]
    with pytest.raises(UnsupportedSetup, match=r"\(multi_modal_inputs were given for "
                       r"Qwen2ForCausalLM\).*\[hf.images_for_text_model\]"):
        _run(text_model, batch)


def test_a_stock_image_feature_model_is_refused(shared):
    import copy

    model = copy.deepcopy(shared)
    inner = model.model
    inner.__class__ = type(inner).__mro__[1]  # back to the stock class
    with pytest.raises(UnsupportedSetup, match=r"\(stock VLM image-feature models \(model\)\): "
                       r"its get_image_features would place each distinct image once.*"
                       r"\[hf.stock_vision_features\]"):
        _run(model, grpo_image_batch(model.config))
