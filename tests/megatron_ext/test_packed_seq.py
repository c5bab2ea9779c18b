"""The plan rides in Megatron's PackedSeqParams; micro-batches come out shaped for GPTModel."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.megatron_ext import PlanPackedSeqParams, prepare_micro_batch

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
