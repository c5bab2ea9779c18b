"""Which groups cross micro-batches, and as which micro-batches (pure: no verl, no megatron)."""

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.verl_ext.cross_groups import plan_cross_groups
from prefix_sharing.workloads import make_workload

CROSS = PrefixSharingConfig(min_prefix_len=1, cross_micro_batch=True)
# 2 agent tasks of 3 episodes (59-65 tokens), common prefixes of 34 and 36 tokens
AGENT = make_workload("agent", vocab_size=512, seed=0, num_tasks=2, num_turns=2, branching=3)
UIDS = [next(g for g, group in enumerate(AGENT.groups) if i in group.members)
        for i in range(len(AGENT.sequences))]


def unique_tokens(members):
    return build_plan([AGENT.sequences[i] for i in members], CROSS).num_tokens_unique


@pytest.mark.parametrize("uids", [UIDS, None], ids=["by_uid", "by_prefix"])
def test_a_group_over_the_budget_runs_as_consecutive_parts_under_it_computing_its_tokens_once(uids):
    # by_prefix: without uids the planner's groups (the two tasks share a system prompt, so
    # they form one group of six, whose common prefix is that prompt)
    cross, rest = plan_cross_groups(AGENT.sequences, 80, CROSS, uids)
    assert cross and rest == []
    covered = []
    for group in cross:
        parts = group.parts()
        assert len(parts) >= 2 and parts[0].first and parts[-1].last
        assert not any(p.first for p in parts[1:]) and not any(p.last for p in parts[:-1])
        for part in parts:
            assert part.tokens_computed <= 80  # the first one includes the prefix
            assert part.batch_indices == sorted(part.batch_indices)
            assert part.tokens_total == sum(len(AGENT.sequences[i]) for i in part.batch_indices)
            covered += part.batch_indices
        assert sorted(i for p in parts for i in p.batch_indices) == list(group.members)
        if uids is not None:  # every branch kept whole: each token computed once
            assert sum(p.tokens_computed for p in parts) == unique_tokens(group.members)
    assert sorted(covered) == list(range(len(AGENT.sequences)))


def test_nothing_crosses_micro_batches_when_off_or_when_a_group_fits():
    off = PrefixSharingConfig(min_prefix_len=1)
    assert plan_cross_groups(AGENT.sequences, 80, off, UIDS) == ([], list(range(6)))
    assert plan_cross_groups(AGENT.sequences, 200, CROSS, UIDS) == ([], list(range(6)))


def test_a_prefix_over_half_the_budget_or_under_min_prefix_len_is_left_to_the_split():
    cross, rest = plan_cross_groups(AGENT.sequences, 70, CROSS, UIDS)  # prefixes 34 and 36
    assert [g.schedule.prefix_len for g in cross] == [34] and rest == [3, 4, 5]
    long_min = PrefixSharingConfig(min_prefix_len=35, cross_micro_batch=True)
    cross, rest = plan_cross_groups(AGENT.sequences, 80, long_min, UIDS)
    assert [g.schedule.prefix_len for g in cross] == [36] and rest == [0, 1, 2]


def test_a_group_that_does_not_fit_one_level_nests_where_the_engine_allows_it():
    # under 30 both 34- and 36-token prefixes are longer than the budget: chunks; under 40
    # they are over half of it: one block, the tails packed under the whole budget
    for budget, blocks in ((30, [3, 2]), (40, [1, 1])):
        assert plan_cross_groups(AGENT.sequences, budget, CROSS, UIDS) == ([], list(range(6)))
        cross, rest = plan_cross_groups(AGENT.sequences, budget, CROSS, UIDS, nested=True)
        assert rest == [] and all(g.nested for g in cross)
        assert [len(g.schedule.blocks) for g in cross] == blocks
        for group in cross:
            parts = group.parts()
            assert max(len(p.group.schedule.suffixes[p.index].plan.input_ids)
                       for p in parts) <= budget  # every tail micro-batch's rows
            # the blocks count where they run: every token once
            assert sum(p.tokens_computed for p in parts) == unique_tokens(group.members)
