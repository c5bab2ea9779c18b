"""Model presets: how a pipeline splits a preset's layers."""

from __future__ import annotations

import dataclasses

import pytest

from prefix_sharing.errors import InputError
from prefix_sharing.presets import get_preset


@pytest.mark.parametrize("model, layers, pp, first", [
    ("tiny", 2, 2, None), ("small-mla", 4, 2, None),  # even: megatron's own split
    ("tiny-mla", 3, 2, 1),  # the dense layer alone, both MoE layers on the last stage
    # DeepSeek-V3's 61 layers: 1 + 15 x 4, 5 + 7 x 8
    ("tiny-mla", 61, 16, 1), ("tiny-mla", 61, 8, 5),
])
def test_the_first_stage_holds_the_rest_when_the_layers_do_not_split_evenly(model, layers, pp,
                                                                           first):
    preset = dataclasses.replace(get_preset(model), num_layers=layers)
    assert preset.first_stage_layers(pp) == first


@pytest.mark.parametrize("model, layers, pp", [("tiny", 2, 3), ("tiny-hybrid", 5, 2)])
def test_a_split_without_layers_for_the_first_stage_or_of_a_hybrid_is_refused(model, layers, pp):
    """tiny: 2 layers over 3 stages; tiny-hybrid: a layer pattern is split evenly only (5
    layers at PP=2 would be 2 + 3 on a GPT)."""
    preset = dataclasses.replace(get_preset(model), num_layers=layers)
    with pytest.raises(InputError, match=f"--pp {pp} does not divide the {model} preset"):
        preset.first_stage_layers(pp)
