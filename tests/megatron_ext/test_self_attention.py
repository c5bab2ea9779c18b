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

from ._distributed import PRESET, run_distributed, tiny_gpt
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


def _fused_rope_job(rank: int) -> dict:
    """Under ``apply_rope_fusion`` (TE's kernels as CPU stand-ins, :mod:`.fake_fused_rope`):
    shared and megatron's own packed THD run, each against the unfused padded model; and a
    control whose fused kernel reads the rotary rows in reverse."""
    from megatron.core.models.common.embeddings import rope_utils

    from .fake_fused_rope import fused_rope_sbhd, installed

    batches = micro_batches()
    padded = forward_backward(tiny_gpt("padded"), batches, "padded")
    report = {}
    with installed() as calls:
        shared = forward_backward(tiny_gpt("shared", apply_rope_fusion=True), batches, "shared",
                                  SHARE_EVERY_PREFIX)
        report["shared_calls"] = dict(calls)
        calls.clear()
        packed = forward_backward(tiny_gpt("packed", apply_rope_fusion=True), batches, "packed")
        report["packed_calls"] = dict(calls)
        rope_utils.fused_apply_rotary_pos_emb = (
            lambda t, freqs, **kw: fused_rope_sbhd(t, freqs[: t.size(0)].flip(0), **kw))
        reversed_rows = forward_backward(tiny_gpt("shared", apply_rope_fusion=True), batches,
                                         "shared", SHARE_EVERY_PREFIX)
    report["shared"] = compare(shared, padded).max_rel_diff
    report["packed"] = compare(packed, padded).max_rel_diff
    report["control"] = compare(reversed_rows, padded).max_rel_diff
    return report


def test_fused_rope_rotates_each_flat_token_at_its_own_position():
    """``apply_rope_fusion=True`` is served: the sharing self-attention hands TE's fused kernel
    (BSHD format, ``[T, 1, heads, dim]``) one rotary row per flat token, so a reuser's tail is
    rotated at its prefix length, where the THD kernel would restart it at 0. Megatron's own
    packed run through the THD kernel pins the stand-ins to the unfused math."""
    report = run_distributed(_fused_rope_job, 1, timeout=600)[0]
    layers = PRESET.num_layers
    assert report["shared_calls"] == {"sbhd": 2 * layers * len(micro_batches())}, report
    assert report["packed_calls"] == {"thd": 2 * layers * len(micro_batches())}, report
    for run in ("shared", "packed"):
        worst = {q: d for q, d in report[run].items() if d > FP32_RTOL}
        assert not worst, f"{run}: {worst}"
    assert report["control"]["logits"] > 1e-3, report["control"]
