"""shared_forward on HF models equals transformers' own forward on the same weights: logits,
log-probs, entropy, loss and every gradient, for every family, attention and sharing shape."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.equivalence import advantages, compare_runs, within_tolerance
from prefix_sharing.fsdp_compat import ATTENTION_FAMILIES, model_kwargs, shared_forward
from prefix_sharing.fsdp_compat.runs import plain_run, shared_run
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import WORKLOADS, make_workload

from ._models import EVERY_PREFIX, PRESET, compare_shared_to_plain, plain_and_shared

@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_every_family_and_attention_matches_the_plain_forward(family, attn_implementation):
    plain, shared = plain_and_shared(family, attn_implementation)
    comparison = compare_shared_to_plain(
        plain, shared, make_workload("tree", vocab_size=PRESET.vocab_size))
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_sharing_shape_matches_the_plain_forward(workload):
    plain, shared = plain_and_shared("qwen2")
    comparison = compare_shared_to_plain(
        plain, shared, make_workload(workload, vocab_size=PRESET.vocab_size))
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_a_sampling_temperature_matches_the_plain_logits_divided_by_it(temperature):
    """``shared_forward(temperature=T)`` end to end against transformers' forward, its logits
    divided by T before the log-softmax (log-probs, entropy, loss, every gradient); the same
    shared run without the temperature is far from that reference."""
    plain, shared = plain_and_shared("llama")
    w = make_workload("agent", vocab_size=PRESET.vocab_size)
    weights = advantages(w.num_tokens, seed=0)
    reference = plain_run(plain, w.sequences, weights, temperature)
    comparison = compare_runs(
        shared_run(shared, w.sequences, weights, EVERY_PREFIX, temperature=temperature), reference)
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff
    dropped = compare_runs(shared_run(shared, w.sequences, weights, EVERY_PREFIX), reference)
    assert all(dropped.max_rel_diff[q] > 1e-3 for q in ("log_probs", "entropy", "loss", "grads"))


def test_prompt_only_matches_the_plain_forward():
    plain, shared = plain_and_shared("qwen3")
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    comparison = compare_shared_to_plain(plain, shared, w, PrefixSharingConfig(mode="prompt_only"))
    assert all(within_tolerance(comparison).values()), comparison.max_rel_diff


def test_bfloat16_is_no_further_from_fp32_than_the_plain_bfloat16_run():
    """flash-attn's rule: the shared bf16 run against the fp32 plain run on the same (rounded)
    weights may be 2x (grads 3x) as far as the plain bf16 run is."""
    plain, shared = plain_and_shared("llama", dtype=torch.bfloat16)
    reference = copy.deepcopy(plain).float()
    w = make_workload("agent", vocab_size=PRESET.vocab_size)
    weights = advantages(w.num_tokens, seed=0)
    ref32 = plain_run(reference, w.sequences, weights)
    shared_vs_ref = compare_runs(_fp32(shared_run(shared, w.sequences, weights, EVERY_PREFIX)), ref32)
    plain_vs_ref = compare_runs(_fp32(plain_run(plain, w.sequences, weights)), ref32)
    verdict = within_tolerance(shared_vs_ref, plain_vs_ref, torch.bfloat16)
    assert all(verdict.values()), (shared_vs_ref.max_rel_diff, plain_vs_ref.max_rel_diff)


def _fp32(run):
    return dataclasses.replace(
        run, logits=run.logits.float(), log_probs=run.log_probs.float(),
        entropy=run.entropy.float(), loss=run.loss.float(),
        grads={k: g.float() for k, g in run.grads.items()})


def test_a_given_plan_is_used_as_is():
    _, shared = plain_and_shared()
    w = make_workload("steprl", vocab_size=PRESET.vocab_size)
    plan = build_plan(w.sequences, EVERY_PREFIX)
    out = shared_forward(shared, w.sequences, plan=plan)
    assert out.plan.digest() == plan.digest()
    assert out.logits.shape == (plan.num_tokens_flat, PRESET.vocab_size)
    assert out.stats.log_probs.shape == (plan.num_tokens_total,)
    assert out.aux_loss is None  # a dense model has no router loss


def test_model_kwargs_pass_the_segments_explicitly():
    """transformers would otherwise infer segments from position resets, and a reuser's tail
    does not restart at 0."""
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    plan = build_plan(w.sequences, EVERY_PREFIX)
    kwargs = model_kwargs(plan)
    assert kwargs["cu_seq_lens_q"] is plan.cu_seqlens_q
    assert kwargs["cu_seq_lens_k"] is plan.cu_seqlens_kv
    assert (kwargs["max_length_q"], kwargs["max_length_k"]) == (plan.max_seqlen_q, plan.max_seqlen_kv)
    assert kwargs["input_ids"].shape == (1, plan.num_tokens_flat)
    assert int((plan.position_ids == 0).sum()) < plan.cu_seqlens_q.numel() - 1  # tails start late


def test_a_model_without_the_sharing_attention_is_refused():
    plain, _ = plain_and_shared()
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    with pytest.raises(ValueError, match="enable_prefix_sharing"):
        shared_forward(plain, w.sequences)
