"""The plan rides in Megatron's PackedSeqParams; micro-batches come out shaped for GPTModel.

Also megatron's stock THD packing (``plain_micro_batch``, verl's layout), the plain baseline.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.megatron_ext import PlanPackedSeqParams, prepare_micro_batch
from prefix_sharing.megatron_ext.packed_seq import plain_micro_batch

SEQS = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]
EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1, backend="torch")


def test_params_say_what_megatron_reads():
    plan = build_plan(SEQS, EVERY_PREFIX)
    params = PlanPackedSeqParams.from_plan(plan, backend="torch")
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 4, 6] and params.cu_seqlens_kv.tolist() == [0, 4, 9]
    # the tensors hold the flat layout, for keys too: what Megatron's THD RoPE must split by
    assert params.cu_seqlens_q_padded is plan.cu_seqlens_q
    assert params.cu_seqlens_kv_padded is plan.cu_seqlens_q
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (4, 5)
    assert params.plan is plan and params.backend == "torch"


def test_rotary_table_is_read_at_each_tokens_absolute_position():
    plan = build_plan(SEQS, EVERY_PREFIX)
    table = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 1, 1, 2)  # [max_len, 1, 1, d]
    per_token = PlanPackedSeqParams.from_plan(plan).per_token_rotary(table)
    assert per_token.shape == (6, 1, 1, 2)
    assert per_token[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 3, 4]  # b's tail starts at 3
    with pytest.raises(ValueError, match="longer than the rotary table"):
        PlanPackedSeqParams.from_plan(plan).per_token_rotary(table[:4])


def test_micro_batch_is_batch_one_thd():
    mb = prepare_micro_batch(SEQS, EVERY_PREFIX, device="cpu")
    assert mb.input_ids.shape == mb.position_ids.shape == (1, 6)
    assert mb.packed_seq_params.plan is mb.plan and mb.packed_seq_params.backend == "torch"


def test_micro_batch_pads_for_tensor_parallelism():
    assert prepare_micro_batch(SEQS, EVERY_PREFIX).plan.num_padding == 0  # no model parallel
    mb = prepare_micro_batch(SEQS, EVERY_PREFIX, pad_to_multiple_of=4)
    assert mb.input_ids.shape == (1, 8) and mb.plan.num_padding == 2


# ------------------------------------------------------------- megatron's stock THD packing
def test_plain_micro_batch_pads_each_sequence_as_verl_does():
    mb = plain_micro_batch(SEQS, pad_to_multiple_of=4, device="cpu")
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 5, 6, 7, 9, 9, 0, 0, 0, 5, 6, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    params = mb.packed_seq_params
    assert type(params) is PackedSeqParams and params.qkv_format == "thd"
    for cu in (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded,
               params.cu_seqlens_kv_padded):
        assert cu.tolist() == [0, 4, 12, 16] and cu.dtype == torch.int32
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (8, 8)
    assert mb.token_rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13]
    assert mb.input_ids[0, mb.token_rows].tolist() == sum(SEQS, [])


def test_plain_micro_batch_without_padding_is_the_packed_batch():
    mb = plain_micro_batch(SEQS, device="cpu")  # no model parallelism: multiple of 1
    assert mb.input_ids.tolist() == [sum(SEQS, [])]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 9, 11]


def _plain_thd_job(rank: int) -> dict:
    from tests.attention.host_reads import count_host_reads

    from ._distributed import tiny_gpt
    from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

    model = tiny_gpt("shared")
    seqs = micro_batches(["grpo"])[0]
    weights = torch.randn(sum(len(s) for s in seqs), 1, generator=torch.Generator().manual_seed(0))
    plain = plain_micro_batch(seqs)
    shared = prepare_micro_batch(seqs, SHARE_EVERY_PREFIX)
    runs = {}
    for name, mb, to_packed in (("plain", plain, lambda x: x.index_select(0, plain.token_rows)),
                                ("shared", shared, shared.plan.restore)):
        model.zero_grad(set_to_none=True)
        logits = to_packed(model(mb.input_ids, mb.position_ids, None,
                                 packed_seq_params=mb.packed_seq_params)[0])
        (logits * weights).sum().backward()
        runs[name] = {"logits": logits.detach(),
                      **{n: p.grad.clone() for n, p in model.named_parameters()}}
    diffs = {k: ((runs["plain"][k] - v).norm() / v.norm()).item()
             for k, v in runs["shared"].items()}

    # the plain path reads the boundaries from the device at its first layer only
    attention = model.decoder.layers[0].self_attention.core_attention
    heads = attention.num_attention_heads_per_partition
    q = torch.randn(plain.input_ids.size(1), heads, attention.hidden_size_per_attention_head)
    params = plain_micro_batch(seqs).packed_seq_params
    reads = [count_host_reads(lambda: attention(q, q, q, None, packed_seq_params=params))
             for _ in range(2)]
    padding = plain.input_ids.size(1) - sum(map(len, seqs))
    return {"diffs": diffs, "reads": reads, "padding": padding}


def test_stock_thd_batch_computes_what_the_shared_batch_computes():
    """TP=2: each sequence padded to a multiple of 2; logits and every gradient within 1e-5."""
    from ._distributed import run_distributed

    for rank, report in enumerate(run_distributed(_plain_thd_job, 2, tp=2, timeout=300)):
        assert report["padding"] > 0  # the per-sequence padding was exercised
        worst = {k: d for k, d in report["diffs"].items() if d > 1e-5}
        assert not worst, f"rank {rank}: {worst}"
        first, second = report["reads"]
        assert first["value_reads"] > 0 and second == {"value_reads": 0, "syncing_ops": 0}
