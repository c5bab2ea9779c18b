"""gpt-oss (sliding-window and full layers, learned sinks, MoE, YaRN RoPE), Gemma 3 and Gemma 4
text models through the sharing attention equal transformers' own eager forward on the same
weights: logits, log-probs, entropy, loss and every gradient (the sinks' included), fp32.

Windows shorter than the prefixes (2: every reuser's gather is trimmed), around the branch
points (8), longer than every sequence (4096); GRPO, step-wise chain, tree with a duplicate and
a strict prefix, agent branches, nothing shared.
"""

from __future__ import annotations

import dataclasses

import pytest

from prefix_sharing.equivalence import advantages, compare_runs, within_tolerance
from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
from prefix_sharing.fsdp_compat.runs import plain_run, shared_run
from prefix_sharing.workloads import WORKLOADS, make_workload

from ._models import EVERY_PREFIX, PRESET, compare_shared_to_plain

WINDOWED = ("gpt_oss", "gemma3_text", "gemma4_text")


def plain_and_shared(family, window, **overrides):
    preset = dataclasses.replace(PRESET, window_size=window)
    plain = build_model(family, preset, attn_implementation="eager", **overrides)
    shared = enable_prefix_sharing(build_model(family, preset, **overrides))
    shared.load_state_dict(plain.state_dict())
    return plain, shared


@pytest.mark.parametrize("window", [2, 8, 4096])
@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_family_matches_transformers_eager_forward(family, window):
    plain, shared = plain_and_shared(family, window)
    comparison = compare_shared_to_plain(
        plain, shared, make_workload("tree", vocab_size=PRESET.vocab_size))
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff


@pytest.mark.parametrize("workload", WORKLOADS)
def test_gpt_oss_matches_for_every_sharing_shape(workload):
    plain, shared = plain_and_shared("gpt_oss", 4)
    comparison = compare_shared_to_plain(
        plain, shared, make_workload(workload, vocab_size=PRESET.vocab_size))
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff


def test_gpt_oss_sinks_get_their_gradient():
    plain, shared = plain_and_shared("gpt_oss", 4)
    weights = advantages(make_workload("grpo", vocab_size=PRESET.vocab_size).num_tokens, seed=0)
    run = shared_run(shared, make_workload("grpo", vocab_size=PRESET.vocab_size).sequences,
                     weights, EVERY_PREFIX)
    sinks = {k: g for k, g in run.grads.items() if k.endswith("self_attn.sinks")}
    assert len(sinks) == PRESET.num_layers and all(g.abs().sum() > 0 for g in sinks.values())


def test_the_window_changes_the_model():
    """Not vacuous: the same weights with a window longer than every sequence differ."""
    short, _ = plain_and_shared("gemma3_text", 2)
    long, _ = plain_and_shared("gemma3_text", 4096)
    w = make_workload("tree", vocab_size=PRESET.vocab_size)
    weights = advantages(w.num_tokens, seed=0)
    diff = compare_runs(plain_run(short, w.sequences, weights),
                        plain_run(long, w.sequences, weights))
    assert diff.max_rel_diff["logits"] > 1e-3


def test_attention_logit_softcapping_is_refused():
    with pytest.raises(ValueError, match="soft-caps its attention logits.*None"):
        plain_and_shared("gemma3_text", 8, attn_logit_softcapping=50.0)


def test_bidirectional_attention_is_refused():
    with pytest.raises(ValueError, match="attends bidirectionally"):
        plain_and_shared("gemma3_text", 8, use_bidirectional_attention=True)
