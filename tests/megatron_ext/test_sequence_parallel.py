"""Tensor parallelism with sequence parallelism (TP=2, SP) computes what the plain model does.

Under sequence parallelism each tensor-parallel rank holds ``T_flat / 2`` tokens of the flat
layout between the attention and MLP blocks (norms, residuals); the QKV projection gathers them
and the output projection scatters them back, so prefix sharing sees the whole flat layout
in attention. On CPU the local spec's torch norm takes part through
``cpu_support._allow_sequence_parallel_torch_norm``; its parameters' gradients are then partial
per rank, and ``forward_backward`` all-reduces them over the tensor-parallel group as megatron's
``finalize_model_grads`` does before the optimizer step.

Compared on the same weights: the shared SP run with the shared and plain runs without SP and
megatron's stock local spec on padded input (fp32, 1e-5 relative), and the plain packed SP run
with the stock one.
"""

from __future__ import annotations

from prefix_sharing import build_plan
from prefix_sharing.engines.megatron import compare, forward_backward
from prefix_sharing.equivalence import FP32_RTOL

from ._distributed import run_distributed, tiny_gpt
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches


def _sequence_parallel_job(rank: int) -> dict:
    batches = micro_batches()
    sp_model = tiny_gpt("shared", sequence_parallel=True)
    tokens_seen = []
    sp_model.decoder.layers[0].self_attention.register_forward_pre_hook(
        lambda module, args, kwargs: tokens_seen.append(args[0].size(0)),  # [s, b, h]
        with_kwargs=True,
    )
    runs = {
        "shared_sp": forward_backward(sp_model, batches, "shared", SHARE_EVERY_PREFIX),
        "packed_sp": forward_backward(sp_model, batches, "packed", SHARE_EVERY_PREFIX),
        "shared": forward_backward(tiny_gpt("shared"), batches, "shared", SHARE_EVERY_PREFIX),
        "padded": forward_backward(tiny_gpt("padded"), batches, "padded", SHARE_EVERY_PREFIX),
    }
    marked = sorted(n for n, p in sp_model.named_parameters()
                    if getattr(p, "sequence_parallel", False))
    pairs = [("shared_sp", "padded"), ("shared_sp", "shared"), ("packed_sp", "padded")]
    return {
        "diffs": {f"{a}_vs_{b}": compare(runs[a], runs[b]).max_rel_diff for a, b in pairs},
        "tokens_seen": tokens_seen[: len(batches)],  # shared run only
        "flat_tokens": [build_plan(b, SHARE_EVERY_PREFIX, pad_to_multiple_of=2).num_tokens_flat
                        for b in batches],
        "marked": marked,
    }


def test_tp2_sequence_parallel_equals_the_plain_model():
    ranks = run_distributed(_sequence_parallel_job, 2, tp=2, timeout=600)
    for rank, report in enumerate(ranks):
        for pair, diffs in report["diffs"].items():
            worst = {q: d for q, d in diffs.items() if d > FP32_RTOL}
            assert not worst, f"rank {rank} {pair}: {worst}"
        # each rank's layers really held half of every flat layout
        assert report["tokens_seen"] == [t // 2 for t in report["flat_tokens"]]
        # every norm (two per layer and the final one) is sequence parallel
        assert len(report["marked"]) == 2 * 2 + 1, report["marked"]
