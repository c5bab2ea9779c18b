"""SharingPlan: restoring, splitting, token views, moving and fingerprinting."""

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan

SEQS = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]


@pytest.fixture
def plan():
    return build_plan(SEQS, PrefixSharingConfig(min_prefix_len=1))


def test_restore_reads_every_token_from_the_row_that_computed_it(plan):
    flat = torch.arange(plan.num_tokens_flat * 2.0).view(-1, 2)
    restored = plan.restore(flat)
    assert restored.shape == (11, 2)
    assert restored[:, 0].tolist() == [2.0 * r for r in plan.kv_index.tolist()]


def test_restore_is_differentiable_and_sums_reuses(plan):
    flat = torch.zeros(plan.num_tokens_flat, requires_grad=True)
    plan.restore(flat).sum().backward()
    # rows 0 and 1 serve a, b and c; row 2 serves a and b; the tails serve one sequence each
    assert flat.grad.tolist() == [3, 3, 2, 1, 1, 1]


def test_restore_refuses_another_layout(plan):
    with pytest.raises(ValueError, match="restore expects 6 flat rows"):
        plan.restore(torch.zeros(7, 3))


def test_split_and_token_views(plan):
    assert [t.tolist() for t in plan.split(plan.token_ids)] == SEQS
    assert plan.next_token_ids.tolist() == [6, 7, 8, 0, 6, 7, 9, 9, 0, 6, 0]
    assert plan.is_last_token.nonzero().flatten().tolist() == [3, 8, 10]
    assert plan.cu_seqlens.tolist() == [0, 4, 9, 11]


def test_sizes(plan):
    assert (plan.num_sequences, plan.num_tokens_total, plan.num_tokens_unique) == (3, 11, 6)
    assert plan.has_sharing and plan.token_ratio == pytest.approx(11 / 6)
    assert "tokens_unique=6" in repr(plan)


def test_has_kv_gather_only_when_a_segment_reads_a_prefix(plan):
    assert plan.has_kv_gather  # b's tail reads a's first three keys
    chains = build_plan([[5, 6, 7, 8], [5, 6], [5, 6, 7]], PrefixSharingConfig(min_prefix_len=1))
    # the shorter ones are strict prefixes of the longest: no segment of their own
    assert chains.has_sharing and not chains.has_kv_gather
    assert chains.kv_gather_index.tolist() == list(range(chains.num_tokens_flat))
    assert not build_plan(SEQS, PrefixSharingConfig(mode="off")).has_kv_gather


def test_to_moves_every_tensor_and_keeps_the_layout(plan):
    moved = plan.to("meta")
    assert all(t.device.type == "meta" for t in (moved.input_ids, moved.kv_index,
                                                 moved.cu_seqlens_q, moved.kv_gather_index))
    assert moved.prefix_lens == plan.prefix_lens and moved.max_seqlen_kv == plan.max_seqlen_kv
    assert moved.cu_seqlens_q_host == plan.cu_seqlens_q_host  # host ints stay on the host


def test_digest_tells_layouts_apart(plan):
    assert plan.digest() == build_plan(SEQS, PrefixSharingConfig(min_prefix_len=1)).digest()
    assert plan.digest() != build_plan(SEQS, PrefixSharingConfig(mode="off")).digest()
    assert plan.digest() != build_plan(SEQS, PrefixSharingConfig(min_prefix_len=1),
                                       pad_to_multiple_of=4).digest()
