"""A CP rank's slice of a plan: its query pieces against their segments' keys are exactly the
plain attention's rows, sliding windows and sinks included (one process: every rank's slice
computed in turn, K/V "gathered" by holding them all)."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention import prefix_attention, varlen_attention
from prefix_sharing.megatron_ext.context_parallel import kv_bytes_per_layer, slice_plan
from prefix_sharing.workloads import make_workload

SEQS = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]
EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1, backend="torch")


def test_worked_example_of_the_docstring():
    plan = build_plan(SEQS, EVERY_PREFIX)
    first, second = slice_plan(plan, 0, 2), slice_plan(plan, 1, 2)
    assert (first.row_start, first.row_stop, second.row_start, second.row_stop) == (0, 3, 3, 6)
    assert first.cu_seqlens_q_host == (0, 3) and first.cu_seqlens_kv_host == (0, 3)
    assert first.kv_gather_index.tolist() == [0, 1, 2]
    assert second.cu_seqlens_q_host == (0, 1, 3) and second.cu_seqlens_kv_host == (0, 4, 9)
    assert second.kv_gather_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 5]
    assert second.position_ids.tolist() == [3, 3, 4]
    # packed positions (a, b, c in order) whose flat row is local: rank 1 owns rows 3, 4, 5
    assert second.token_positions.tolist() == [3, 7, 8]
    assert first.token_positions.numel() + second.token_positions.numel() == plan.num_tokens_total


def test_rows_must_divide_by_the_cp_size():
    with pytest.raises(ValueError, match="multiple of the context-parallel size"):
        slice_plan(build_plan(SEQS, EVERY_PREFIX), 0, 4)


def _cp_attention(q, k, v, plan, size, local_keys_only=False, **band):
    """Every rank's output rows, concatenated; ``local_keys_only`` is the wrong construction
    (each rank sees its own K/V rows in place of the other ranks'); ``band``: ``window`` and
    ``sinks``."""
    rows = []
    for rank in range(size):
        cp = slice_plan(plan, rank, size)
        lo, hi = cp.row_start, cp.row_stop
        kk, vv = k, v
        if local_keys_only:
            kk, vv = k[lo:hi].repeat(size, 1, 1), v[lo:hi].repeat(size, 1, 1)
        rows.append(varlen_attention(
            q[lo:hi], kk.index_select(0, cp.kv_gather_index),
            vv.index_select(0, cp.kv_gather_index),
            cp.cu_seqlens_q, cp.cu_seqlens_kv, cp.max_seqlen_q, cp.max_seqlen_kv, backend="torch",
            cu_seqlens_q_host=cp.cu_seqlens_q_host, cu_seqlens_k_host=cp.cu_seqlens_kv_host,
            **band,
        ))
    return torch.cat(rows)


@pytest.mark.parametrize("workload", ["grpo", "tree", "agent", "none"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_slices_give_the_plain_attention_rows(workload, size):
    seqs = make_workload(workload, vocab_size=50, seed=size).sequences
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=2 * size)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(plan.num_tokens_flat, h, 8, generator=gen, dtype=torch.float64)
               for h in (3, 1, 1))  # 3 query heads over 1 K/V head: no head count divides
    reference = prefix_attention(q, k, v, plan, backend="torch")
    torch.testing.assert_close(_cp_attention(q, k, v, plan, size), reference,
                               rtol=1e-10, atol=1e-14)
    wrong = _cp_attention(q, k, v, plan, size, local_keys_only=True)
    assert (wrong - reference).abs().max() > 1e-3  # the mutation is caught


@pytest.mark.parametrize("workload", ["tree", "agent"])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_windows_and_sinks_over_the_slices_are_the_plain_band(workload, window):
    """A window counts keys back from each query's logical position, and a local piece's keys
    are its segment's in logical order: the bottom-right band over them is the plain one."""
    seqs = make_workload(workload, vocab_size=50, seed=window).sequences
    plan = build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=4)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(plan.num_tokens_flat, h, 8, generator=gen, dtype=torch.float64)
               for h in (2, 1, 1))
    band = dict(window=window, sinks=torch.randn(2, generator=gen, dtype=torch.float64))
    reference = prefix_attention(q, k, v, plan, backend="torch", **band)
    torch.testing.assert_close(_cp_attention(q, k, v, plan, 4, **band), reference,
                               rtol=1e-10, atol=1e-14)
    unbanded = _cp_attention(q, k, v, plan, 4, sinks=band["sinks"])
    assert (unbanded - reference).abs().max() > 1e-3  # the window changes the rows


def test_bytes_scale_with_the_computed_rows():
    plan = build_plan(make_workload("grpo", vocab_size=50, seed=0).sequences, EVERY_PREFIX,
                      pad_to_multiple_of=2)
    shared = kv_bytes_per_layer(plan.num_tokens_flat, 2, 2, 16, 2)
    plain = kv_bytes_per_layer(plan.num_tokens_total + plan.num_tokens_total % 2, 2, 2, 16, 2)
    assert shared == 2 * (plan.num_tokens_flat // 2) * 2 * 16 * 2
    assert shared < plain
