"""``backend="flex"``: a prefix-sharing GPTModel runs each layer's attention as one FlexAttention
call over the plan's flat rows (execution ``"tree_mask"``) and gives what the torch backend and
the plain model give, forward and backward, at TP=1 and TP=2.

torch 2.13 has no FlexAttention backward on CPU: the ranks put the CPU implementation of its
documented semantics (``tests/attention/fake_kernels.flex_attention``, dense and differentiable)
in the kernel's place, so what runs here is the backend's own argument construction - the
plan's tree mask, the layout of q, k, v, GQA - through megatron's layers.
"""

from __future__ import annotations

import dataclasses

import pytest

from prefix_sharing.engines.megatron import compare, forward_backward
from prefix_sharing.equivalence import FP32_RTOL

from ..attention import fake_kernels
from ._distributed import PRESET, run_distributed, tiny_gpt
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

WORKLOADS = ["grpo", "tree"]  # shared prompts; a tree with a duplicate and a strict prefix
FLEX = dataclasses.replace(SHARE_EVERY_PREFIX, backend="flex")
TORCH = dataclasses.replace(SHARE_EVERY_PREFIX, backend="torch")


def _flex_job(rank: int) -> dict:
    from prefix_sharing.attention import flex_backend
    from prefix_sharing.attention.sources import key_rows
    from prefix_sharing.megatron_ext import prepare_micro_batch

    calls = []

    def counted(device):
        calls.append(device.type)
        return fake_kernels.flex_attention

    pytest.MonkeyPatch().setattr(flex_backend, "_flex_attention", counted)
    batches = micro_batches(WORKLOADS)
    model = tiny_gpt("shared")
    on_flex = forward_backward(model, batches, "shared", FLEX)
    on_torch = forward_backward(model, batches, "shared", TORCH)
    plans = [prepare_micro_batch(seqs, FLEX).plan for seqs in batches]
    return {
        "flex_vs_torch": compare(on_flex, on_torch).max_rel_diff,
        "flex_vs_plain": compare(on_flex, forward_backward(tiny_gpt("padded"), batches,
                                                           "padded")).max_rel_diff,
        "calls": len(calls),
        "executions": [key_rows(p, backend="flex").execution for p in plans],
        "heads": model.decoder.layers[0].self_attention.num_attention_heads_per_partition,
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request):
    tp = request.param
    return tp, run_distributed(_flex_job, tp, tp=tp, timeout=600)


def test_flex_backend_equals_torch_backend_and_the_plain_model(ranks):
    tp, reports = ranks
    for rank, report in enumerate(reports):
        for pair in ("flex_vs_torch", "flex_vs_plain"):
            worst = {q: d for q, d in report[pair].items() if d > FP32_RTOL}
            assert not worst, f"tp{tp} rank {rank} {pair}: {worst}"


def test_each_layer_is_one_flex_call_over_the_tree(ranks):
    tp, reports = ranks
    for report in reports:
        assert report["heads"] == PRESET.num_attention_heads // tp
        assert report["executions"] == ["tree_mask"] * len(WORKLOADS)
        assert report["calls"] == PRESET.num_layers * len(WORKLOADS)
