"""The prefix-sharing self-attention rotates every token at its absolute position, exactly as
megatron's own RoPE would in the padded layout, whatever the RoPE options and however the
rotary table is passed.

Shared micro-batches (all sharing shapes) against megatron's stock local spec on padded input,
same weights; fp32, logits / log-probs / entropy / loss / every gradient within 1e-5 relative.
The default RoPE is covered by ``test_equivalence.py``; here the options that change it.
"""

from __future__ import annotations

import torch

from prefix_sharing.engines.megatron import compare, forward_backward
from prefix_sharing.equivalence import FP32_RTOL

from ._distributed import run_distributed, tiny_gpt
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

ROPE_VARIANTS = {
    "interleaved": dict(rotary_interleaved=True),
    "no_rope_in_layer_2": dict(no_rope_freq=[0, 1]),  # megatron skips RoPE in that layer
}


def _rope_variants_job(rank: int) -> dict:
    batches = micro_batches()
    report = {}
    for name, overrides in ROPE_VARIANTS.items():
        shared = forward_backward(tiny_gpt("shared", **overrides), batches, "shared",
                                  SHARE_EVERY_PREFIX)
        padded = forward_backward(tiny_gpt("padded", **overrides), batches, "padded")
        report[name] = compare(shared, padded).max_rel_diff
    report["positional_vs_keyword"] = _positional_rotary_table()
    return report


def _positional_rotary_table() -> float:
    """Calls one layer's self-attention with the rotary table passed positionally, as a caller
    of ``Attention.forward``'s signature may, and by keyword; returns the largest difference."""
    from prefix_sharing.megatron_ext import prepare_micro_batch

    model = tiny_gpt("shared")
    mb = prepare_micro_batch(micro_batches(["tree"])[0], SHARE_EVERY_PREFIX)
    params = mb.packed_seq_params
    table = model.rotary_pos_emb(params.max_seqlen_kv, packed_seq=True)
    attention = model.decoder.layers[0].self_attention
    hidden = torch.randn(mb.plan.num_tokens_flat, 1, model.config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    by_keyword, _ = attention(hidden, None, rotary_pos_emb=table, packed_seq_params=params)
    positional, _ = attention(hidden, None, None, None, table, packed_seq_params=params)
    unrotated, _ = attention(hidden, None, packed_seq_params=params)
    assert not torch.allclose(unrotated, by_keyword)  # the table matters
    return (positional - by_keyword).abs().max().item()


def test_rope_options_and_positional_tables_match_the_plain_model():
    report = run_distributed(_rope_variants_job, 1, timeout=600)[0]
    assert report.pop("positional_vs_keyword") == 0.0
    for variant, diffs in report.items():
        worst = {q: d for q, d in diffs.items() if d > FP32_RTOL}
        assert not worst, f"{variant}: {worst}"
