"""The built-in workloads have the sharing shapes their names promise."""

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.cross_micro_batch import common_prefix_len
from prefix_sharing.workloads import LONG_WORKLOADS, WORKLOADS, make_workload, scale_lengths

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def test_grpo_groups_share_their_prompt():
    w = make_workload("grpo", num_prompts=2, group_size=3)
    assert len(w.sequences) == 6 and [g.members for g in w.groups] == [[0, 1, 2], [3, 4, 5]]
    for g in w.groups:
        prompts = {tuple(w.sequences[m][: g.prompt_len].tolist()) for m in g.members}
        assert len(prompts) == 1


def test_steprl_samples_extend_each_other():
    w = make_workload("steprl", num_chains=1, num_steps=3)
    a, b, c = (s.tolist() for s in w.sequences)
    assert b[: len(a)] == a and c[: len(b)] == b


def test_tree_has_a_duplicate_and_a_strict_prefix():
    seqs = [tuple(s.tolist()) for s in make_workload("tree").sequences]
    assert len(set(seqs)) == len(seqs) - 1
    assert any(a != b and b[: len(a)] == a for a in seqs for b in seqs)


def test_agent_episodes_share_the_system_prompt_across_tasks():
    w = make_workload("agent", system_len=24)
    assert len({tuple(s[:24].tolist()) for s in w.sequences}) == 1
    assert len(w.groups) == 2


def test_none_shares_not_even_a_token():
    plan = build_plan(make_workload("none").sequences, EVERY_PREFIX)
    assert not plan.has_sharing


def test_history_is_one_long_history_and_its_branches():
    w = make_workload("history", history_len=40, branches=5, branch_len=7)
    assert [s.numel() for s in w.sequences] == [47] * 5
    assert [(g.prompt_len, g.members) for g in w.groups] == [(40, [0, 1, 2, 3, 4])]
    assert all(s[:40].equal(w.sequences[0][:40]) for s in w.sequences)
    assert len({int(s[40]) for s in w.sequences}) == 5  # the branches part at once
    assert common_prefix_len(w.sequences) == 40
    assert build_plan(w.sequences, EVERY_PREFIX).num_tokens_unique == 40 + 5 * 7


def test_history_bench_size_is_issue_31s_shape_at_length_scale_64():
    assert scale_lengths(BENCH_SIZES["history"], 64) == dict(
        history_len=32768, branches=8, branch_len=2048)
    w = make_workload("history", **scale_lengths(BENCH_SIZES["history"], 8))
    assert [s.numel() for s in w.sequences] == [4096 + 256] * 8


@pytest.mark.parametrize("sizes, message", [
    (dict(branches=1), "branches must be between 2 and the vocabulary"),
    (dict(branches=12, vocab_size=11), r"vocabulary \(11\)"),
    (dict(branch_len=0), "history_len and branch_len must be at least 1"),
])
def test_history_refuses_shapes_it_cannot_build(sizes, message):
    with pytest.raises(ValueError, match=message):
        make_workload("history", **sizes)


def test_long_workloads_are_not_among_the_defaults():
    assert "history" in LONG_WORKLOADS and "history" not in WORKLOADS


@pytest.mark.parametrize("name", list(WORKLOADS) + list(LONG_WORKLOADS))
def test_workloads_are_seeded(name):
    a, b = make_workload(name, seed=3), make_workload(name, seed=3)
    assert all(x.equal(y) for x, y in zip(a.sequences, b.sequences))
    assert any(not x.equal(y) for x, y in zip(a.sequences, make_workload(name, seed=4).sequences))


def test_unknown_workload_is_named():
    with pytest.raises(ValueError, match="unknown workload 'forest'; choose from grpo, steprl"):
        make_workload("forest")


def test_length_scale_grows_every_segment_and_keeps_the_sharing_shape():
    sizes = dict(depth=2, branching=2, prompt_len=(10, 12), node_len=(3, 5))
    assert scale_lengths(sizes, 4) == dict(depth=2, branching=2, prompt_len=(40, 48),
                                           node_len=(12, 20))
    small, large = make_workload("tree", **sizes), make_workload("tree", **scale_lengths(sizes, 4))
    assert len(small.sequences) == len(large.sequences)
    assert all(4 * 10 <= s.numel() for s in large.sequences)
    plans = [build_plan(w.sequences, EVERY_PREFIX) for w in (small, large)]
    assert plans[0].cu_seqlens_q.numel() == plans[1].cu_seqlens_q.numel()  # the same segments
    agent = scale_lengths(dict(num_tasks=2, system_len=24, turn_len=(4, 10)), 3)
    assert agent == dict(num_tasks=2, system_len=72, turn_len=(12, 30))


def test_length_scale_below_one_is_refused():
    with pytest.raises(ValueError, match="length scale must be at least 1; got 0"):
        scale_lengths({"prompt_len": (1, 2)}, 0)
