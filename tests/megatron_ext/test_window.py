"""Sliding windows and sinks in the Megatron path: shared equals megatron's stock local spec on
padded input (which masks the band with ``get_sliding_window_causal_mask`` and adds the sink
with ``SoftmaxOne``, both on CPU in megatron-core 0.16.1), and the plain packed layout -
logits, log-probs, entropy, loss and every gradient, the sinks' included; TP=1 and TP=2 (the
sinks split with the heads). fp32: within 1e-5 relative.

Windows: shorter than the prefixes (3, and the preset's 16 against a 46-token chain, so
reusers' gathers are trimmed and branch points fall inside a window), longer than every
sequence; GRPO, step-wise chain, tree with a duplicate and a strict prefix, no sharing.
"""

from __future__ import annotations

import dataclasses

import pytest

from prefix_sharing.engines.megatron import compare, forward_backward, gpt_model
from prefix_sharing.equivalence import FP32_RTOL
from prefix_sharing.presets import get_preset

from ._distributed import run_distributed
from ._equivalence import micro_batches, runs_by_layout

WINDOWED = get_preset("tiny-window")  # 4 layers, windows of 16 on layers 1 and 3, learned sinks
VARIANTS = {
    "preset": {},
    "every_layer_3_off_by_one": dict(window_size=3, window_full_every=None,
                                     softmax_type="off-by-one"),
    "longer_than_sequences": dict(window_size=4096),
    "window_5_vanilla": dict(window_size=5, softmax_type="vanilla"),
}
LAYOUTS = {"tp1": (1, list(VARIANTS)), "tp2": (2, ["preset", "every_layer_3_off_by_one"])}


def _window_job(rank: int, variants: list[str]) -> dict:
    batches = micro_batches()
    report = {}
    for name in variants:
        preset = dataclasses.replace(WINDOWED, **VARIANTS[name])
        ours, stock = gpt_model(preset, layout="shared"), gpt_model(preset, layout="padded")
        shared, padded, differences = runs_by_layout(ours, stock, batches)
        report[name] = {
            **differences,
            "sink_grads": sorted(k for k, g in shared.grads.items()
                                 if k.endswith("softmax_offset") and g.abs().sum() > 0),
        }
        if name == "window_5_vanilla":  # the window really changes the model's outputs
            full = dataclasses.replace(preset, window_size=None)
            unwindowed = forward_backward(gpt_model(full, layout="padded"), batches, "padded")
            report[name]["vs_full_attention"] = compare(padded, unwindowed).max_rel_diff
    return report


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    world, variants = LAYOUTS[request.param]
    return request.param, run_distributed(_window_job, world, variants, tp=world, pp=1,
                                          timeout=900)


def test_windows_and_sinks_shared_equal_the_stock_padded_model(layout):
    name, ranks = layout
    for rank, report in enumerate(ranks):
        for variant, r in report.items():
            for pair in ("shared_vs_padded", "shared_vs_packed"):
                worst = {q: d for q, d in r[pair].items() if d > FP32_RTOL}
                assert not worst, f"{name} rank {rank} {variant} {pair}: {worst}"
            if "vs_full_attention" in r:  # not vacuous: the window changes the model's outputs
                assert r["vs_full_attention"]["logits"] > 1e-3, r["vs_full_attention"]


def test_learned_sinks_get_gradients_on_every_layer(layout):
    _, ranks = layout
    for report in ranks:
        assert len(report["preset"]["sink_grads"]) == WINDOWED.num_layers
        if "longer_than_sequences" in report:
            assert len(report["longer_than_sequences"]["sink_grads"]) == WINDOWED.num_layers
        assert report["every_layer_3_off_by_one"]["sink_grads"] == []  # a fixed zero logit
