"""Per-layer kernel state and the FP8 refusal of the prefix-sharing core attention.

Transformer Engine's attention module keeps state between calls (its kernel choice, FP8
metadata), so each layer must keep its own, as megatron's TE attention does; and FP8 attention
with that kernel is refused, not run unvalidated.
"""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.megatron_ext.checks import UnsupportedSetupError

from ._distributed import run_distributed, tiny_gpt
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches


def _kernel_state_job(rank: int) -> dict:
    from prefix_sharing.megatron_ext import core_attention, prepare_micro_batch

    model = tiny_gpt("shared")
    mb = prepare_micro_batch(micro_batches(["grpo"])[0], SHARE_EVERY_PREFIX)
    caches = []
    kernel = core_attention.prefix_attention

    def recording(*args, kernel_cache=None, **kwargs):
        caches.append(kernel_cache)
        return kernel(*args, kernel_cache=kernel_cache, **kwargs)

    core_attention.prefix_attention = recording
    try:
        for _ in range(2):  # two steps
            model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
    finally:
        core_attention.prefix_attention = kernel
    layers = [layer.self_attention.core_attention for layer in model.decoder.layers]
    stock_keys = set(tiny_gpt("padded").state_dict())

    # FP8 with the TE kernel: refused before any kernel is looked up
    attention = layers[0]
    attention.config.fp8 = "hybrid"
    q = torch.randn(mb.plan.num_tokens_flat, attention.num_attention_heads_per_partition,
                    attention.hidden_size_per_attention_head, dtype=torch.bfloat16)
    mb.packed_seq_params.backend = "te"
    try:
        attention(q, q, q, None, packed_seq_params=mb.packed_seq_params)
        refusal = None
    except UnsupportedSetupError as error:
        refusal = str(error)
    return {
        "cache_ids": [id(c) for c in caches],
        "layer_cache_ids": [id(layer.kernel_cache) for layer in layers],
        "same_state_dict_keys": set(model.state_dict()) == stock_keys,
        "refusal": refusal,
    }


@pytest.fixture(scope="module")
def report() -> dict:
    return run_distributed(_kernel_state_job, 1, timeout=300)[0]


def test_each_layer_passes_its_own_kernel_cache_every_step(report):
    layer_ids = report["layer_cache_ids"]
    assert len(set(layer_ids)) == len(layer_ids) == 2
    assert report["cache_ids"] == layer_ids * 2


def test_the_kernel_cache_leaves_the_checkpoint_format_alone(report):
    assert report["same_state_dict_keys"]


def test_fp8_with_the_te_kernel_is_refused(report):
    assert report["refusal"] is not None and "fp8" in report["refusal"]
