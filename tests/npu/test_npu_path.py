"""``backend="npu"``: a prefix-sharing GPTModel runs forward and backward through
``torch_npu.npu_fusion_attention`` and gives what the torch backend gives.

``torch_npu`` is the stand-in of ``tests/attention/fake_kernels.py``, which checks the
operator's documented arguments (TND, ``sparse_mode=3`` with the compressed mask, host lists of
cumulative ends, no empty segment, GQA heads) and computes its documented semantics. It is put
into each spawned rank's ``sys.modules``. TP=1 and TP=2 (each rank holds half the heads).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.attention.backends import resolve_backend
from prefix_sharing.engines.megatron import compare, forward_backward
from prefix_sharing.equivalence import FP32_RTOL

from ..attention import fake_kernels
from ..megatron_ext._distributed import PRESET, run_distributed, tiny_gpt
from ..megatron_ext._equivalence import SHARE_EVERY_PREFIX, micro_batches

WORKLOADS = ["grpo", "tree"]  # shared prompts; a tree with a duplicate and a strict prefix
NPU = dataclasses.replace(SHARE_EVERY_PREFIX, backend="npu")
TORCH = dataclasses.replace(SHARE_EVERY_PREFIX, backend="torch")


def _npu_job(rank: int) -> dict:
    from prefix_sharing.attention.sources import source_layout
    from prefix_sharing.megatron_ext import prepare_micro_batch

    batches = micro_batches(WORKLOADS)
    model = tiny_gpt("shared")
    try:  # torch_npu is not installed in the test environment
        forward_backward(model, batches, "shared", NPU)
        missing = None
    except ImportError as err:
        missing = str(err)
    npu = fake_kernels.install_torch_npu(pytest.MonkeyPatch())
    on_npu = forward_backward(model, batches, "shared", NPU)
    on_torch = forward_backward(model, batches, "shared", TORCH)
    plans = [prepare_micro_batch(seqs, NPU).plan for seqs in batches]
    return {
        "missing": missing,
        "npu_vs_torch": compare(on_npu, on_torch).max_rel_diff,
        "npu_vs_plain": compare(on_npu, forward_backward(tiny_gpt("padded"), batches, "padded"))
        .max_rel_diff,
        "calls": [(c["actual_seq_qlen"], c["actual_seq_kvlen"]) for c in npu.calls],
        "heads": model.decoder.layers[0].self_attention.num_attention_heads_per_partition,
        # per micro-batch, the calls of one layer: the parts of its attention over sources
        "segments": [[(list(part.cu_seqlens_q_host[1:]), list(part.cu_seqlens_k_host[1:]))
                      for part in source_layout(p).parts] for p in plans],
        "own_segments": [list(p.cu_seqlens_q_host[1:]) for p in plans],
        # sequences that compute nothing (duplicates, strict prefixes) have no segment
        "sequences_without_segment": sum(
            len(seqs) - (len(p.cu_seqlens_q_host) - 1 - (p.num_padding > 0))
            for seqs, p in zip(batches, plans)
        ),
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request):
    tp = request.param
    return tp, run_distributed(_npu_job, tp, tp=tp, timeout=600)


def test_npu_backend_equals_torch_backend_and_the_plain_model(ranks):
    tp, reports = ranks
    for rank, report in enumerate(reports):
        for pair in ("npu_vs_torch", "npu_vs_plain"):
            worst = {q: d for q, d in report[pair].items() if d > FP32_RTOL}
            assert not worst, f"tp{tp} rank {rank} {pair}: {worst}"


def test_every_layer_calls_the_kernel_with_the_plans_host_segments(ranks):
    """Host lists of cumulative ends (the fake rejects tensors, a leading 0 or a causal
    segment without queries), per layer and micro-batch the calls of the attention over
    sources: the plan's own segments (queries over their own keys), then the shared nodes'
    rectangles; sequences with nothing to compute are left out of the lists."""
    tp, reports = ranks
    for report in reports:
        assert report["heads"] == PRESET.num_attention_heads // tp
        per_batch = [call for parts in report["segments"] for _ in range(PRESET.num_layers)
                     for call in parts]
        assert report["calls"] == per_batch
        assert [parts[0] for parts in report["segments"]] == [
            (own, own) for own in report["own_segments"]]
        assert all(len(parts) == 2 for parts in report["segments"])  # every micro-batch shares
        assert report["sequences_without_segment"] > 0  # the tree workload's duplicate


def test_forcing_npu_without_torch_npu_names_the_missing_package(ranks):
    _, reports = ranks
    for report in reports:
        assert report["missing"] is not None
        assert "torch_npu" in report["missing"] and "prefix-sharing[npu]" in report["missing"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda")])
def test_auto_never_picks_npu_off_ascend_even_with_torch_npu_installed(monkeypatch, device, dtype):
    fake_kernels.install_torch_npu(monkeypatch)
    fake_kernels.hide(monkeypatch, "flash_attn", "transformer_engine")
    assert resolve_backend("auto", device, dtype) == "torch"
