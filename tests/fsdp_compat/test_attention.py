"""The sharing attention function: what it needs from the forward, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff
from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.fsdp_compat import model_kwargs, prefix_sharing_attention, shared_forward
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import make_workload

from ._models import PRESET, plain_and_shared

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def _batch():
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    return w.sequences, build_plan(w.sequences, EVERY_PREFIX)


def test_transformers_builds_no_mask_for_it():
    """No mask function is registered, so transformers skips the (T, T) mask entirely."""
    _, shared = plain_and_shared()
    seen = []
    layer = shared.model.layers[0].self_attn
    layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["attention_mask"]),
                                    with_kwargs=True)
    sequences, plan = _batch()
    shared_forward(shared, sequences, plan=plan)
    assert seen == [None]


def test_a_forward_without_the_plan_is_refused():
    _, shared = plain_and_shared()
    sequences, plan = _batch()
    with pytest.raises(ValueError, match="needs the micro-batch's plan"):
        shared(input_ids=plan.input_ids[None], position_ids=plan.position_ids[None])


def test_a_padding_mask_is_refused():
    _, shared = plain_and_shared()
    _, plan = _batch()
    kwargs = model_kwargs(plan)
    q = k = v = torch.zeros(1, 4, plan.num_tokens_flat, 16)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        prefix_sharing_attention(shared.model.layers[0].self_attn, q, k, v,
                                 torch.ones(1, 1, 2, 2), sharing_plan=kwargs["sharing_plan"])


def test_attention_dropout_in_training_is_refused():
    _, shared = plain_and_shared(attention_dropout=0.1)
    sequences, plan = _batch()
    shared.train()
    with pytest.raises(ValueError, match="no attention dropout"):
        shared_forward(shared, sequences, plan=plan)


def test_a_sliding_window_shorter_than_the_sequences_is_served_exactly():
    """Qwen2's window is a layer attribute (gpt-oss and Gemma pass it as a keyword)."""
    plain, shared = plain_and_shared("qwen2", "eager", use_sliding_window=True,
                                     sliding_window=4, max_window_layers=0)
    sequences, plan = _batch()  # sequences of 16-40 tokens
    out = shared_forward(shared, sequences, plan=plan)
    for i in (0, len(sequences) - 1):
        reference = plain(input_ids=sequences[i][None]).logits[0]
        rows = plan.kv_index[plan.cu_seqlens[i]:plan.cu_seqlens[i + 1]]
        assert max_rel_diff(out.logits[rows], reference) <= FP32_RTOL  # relative to the logits' scale


def test_attention_logit_softcapping_passed_by_the_layer_is_refused():
    _, shared = plain_and_shared()
    _, plan = _batch()
    q = torch.zeros(1, 4, plan.num_tokens_flat, 16)
    with pytest.raises(ValueError, match="soft-caps its attention logits.*softcap=30.0"):
        prefix_sharing_attention(shared.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None,
                                 sharing_plan=plan, softcap=30.0)


def test_a_sliding_window_no_sequence_reaches_changes_nothing_and_runs():
    plain, shared = plain_and_shared("qwen2", use_sliding_window=True, sliding_window=64,
                                     max_window_layers=0)
    sequences, plan = _batch()
    out = shared_forward(shared, sequences, plan=plan)
    longest = max(len(s) for s in sequences)
    assert longest <= 64
    reference = plain(input_ids=sequences[0][None]).logits[0]
    rows = plan.kv_index[: len(sequences[0])]
    assert max_rel_diff(out.logits[rows], reference) <= FP32_RTOL  # relative to the logits' scale


def test_the_configs_kernel_is_the_one_that_runs():
    """The config's backend travels in the forward's keywords to every layer: flash-attn,
    asked for on a float32 model, refuses in the first layer."""
    _, shared = plain_and_shared()
    sequences, _ = _batch()
    with pytest.raises(ValueError, match="'flash_attn' computes in"):
        shared_forward(shared, sequences, PrefixSharingConfig(backend="flash_attn"))
