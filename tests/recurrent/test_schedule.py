"""The recurrence schedule: pieces cut at every branch point, parents, depth buckets, and the
convolution's per-row predecessors along each row's own path."""

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.recurrent import build_schedule, recurrence_schedule
from prefix_sharing.workloads import WORKLOADS, make_workload

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def test_the_plans_worked_example():
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]], EVERY_PREFIX)
    schedule = build_schedule(plan)
    # b branches after a's row 2: a's segment is cut there; b's tail continues piece 0
    assert [(p.start, p.end, p.parent, p.depth) for p in schedule.pieces] == [
        (0, 3, -1, 0), (3, 4, 0, 1), (4, 6, 0, 1)]
    first, second = schedule.buckets
    assert first.rows.tolist() == [0, 1, 2] and first.cu_seqlens_host == (0, 3)
    assert first.parent_index is None
    assert second.rows.tolist() == [3, 4, 5] and second.cu_seqlens_host == (0, 1, 3)
    assert second.parent_index.tolist() == [0, 0] and second.cu_seqlens.tolist() == [0, 1, 3]
    assert schedule.inverse_order is None  # buckets concatenated are already in flat order
    # row 5 (b's last token) reads b's 9 at row 4, then the shared 7 and 6 at rows 2 and 1
    assert schedule.conv_predecessors(4).tolist() == [
        [-1, -1, -1], [-1, -1, 0], [-1, 0, 1], [0, 1, 2], [0, 1, 2], [1, 2, 4]]
    assert schedule.segment_conv_states(3).tolist() == [[-1, -1], [1, 2]]


def test_branches_inside_a_providers_tail_cut_it_twice():
    # the planner lets b (lexicographically first) compute [1 2 3 4 5]; a, given first,
    # reuses b's [1 2] and computes [9] (flat row 0); c reuses b's [1 2 3 4] and computes
    # [6 7]; d duplicates c and computes nothing
    seqs = [[1, 2, 9], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [1, 2, 3, 4, 6, 7]]
    plan = build_plan(seqs, EVERY_PREFIX)
    assert plan.input_ids.tolist() == [9, 1, 2, 3, 4, 5, 6, 7]
    schedule = build_schedule(plan)
    # b's rows 1-5 are cut after row 2 (a branches) and after row 4 (c branches)
    assert [(p.start, p.end, p.parent, p.depth) for p in schedule.pieces] == [
        (0, 1, 1, 1), (1, 3, -1, 0), (3, 5, 1, 1), (5, 6, 2, 2), (6, 8, 2, 2)]
    assert [b.rows.tolist() for b in schedule.buckets] == [[1, 2], [0, 3, 4], [5, 6, 7]]
    assert schedule.buckets[1].parent_index.tolist() == [0, 0]
    assert schedule.buckets[2].parent_index.tolist() == [1, 1]  # piece 2 is 2nd of bucket 1
    assert schedule.inverse_order.tolist() == [2, 0, 1, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_row_once_and_every_parent_one_bucket_up(workload):
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX, pad_to_multiple_of=8)
    schedule = build_schedule(plan)
    rows = torch.cat([b.rows for b in schedule.buckets])
    assert sorted(rows.tolist()) == list(range(plan.num_tokens_flat))
    order = rows if schedule.inverse_order is None else rows[schedule.inverse_order]
    assert order.tolist() == list(range(plan.num_tokens_flat))
    for depth, bucket in enumerate(schedule.buckets[1:], start=1):
        previous = schedule.buckets[depth - 1].pieces
        for piece, parent_pos in zip(bucket.pieces, bucket.parent_index.tolist()):
            assert schedule.pieces[piece].parent == previous[parent_pos]
            assert schedule.pieces[piece].depth == depth


@pytest.mark.parametrize("workload", WORKLOADS)
def test_predecessors_are_the_tokens_before_each_row_in_every_sequence(workload):
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX)
    width = 4
    pred = build_schedule(plan).conv_predecessors(width)
    ids = torch.cat([plan.input_ids, torch.tensor([-1])])  # row -1 reads "no token"
    for seq, rows in zip(plan.split(plan.token_ids), plan.split(plan.kv_index)):
        padded = torch.cat([torch.full((width - 1,), -1), seq])
        for j, row in enumerate(rows.tolist()):
            assert ids[pred[row]].tolist() == padded[j: j + width - 1].tolist()


def test_no_sharing_is_one_bucket_in_flat_order():
    plan = build_plan(make_workload("none").sequences, EVERY_PREFIX)
    schedule = build_schedule(plan)
    assert len(schedule.buckets) == 1 and schedule.inverse_order is None
    assert schedule.buckets[0].cu_seqlens_host == plan.cu_seqlens_q_host


def test_the_schedule_is_built_once_per_plan():
    plan = build_plan(make_workload("grpo").sequences, EVERY_PREFIX)
    assert recurrence_schedule(plan) is recurrence_schedule(plan)
    assert recurrence_schedule(plan).conv_predecessors(4) is recurrence_schedule(
        plan).conv_predecessors(4)


def test_a_micro_batch_reading_stored_blocks_has_no_recurrence():
    """A suffix micro-batch of a group across micro-batches starts from its blocks' K/V only:
    a recurrent layer would need their state, so its schedule is refused by name."""
    from prefix_sharing.cross_micro_batch import plan_group

    sequences = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 4], [5, 6, 7, 2]]
    suffix = plan_group(sequences, 2, EVERY_PREFIX).suffixes[0]
    assert suffix.plan.external_rows > 0
    with pytest.raises(ValueError, match="external K/V rows .* no recurrence"):
        build_schedule(suffix.plan)
