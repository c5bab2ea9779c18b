"""The built-in workloads have the sharing shapes their names promise."""

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.workloads import WORKLOADS, make_workload, scale_lengths

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


@pytest.mark.parametrize("name", list(WORKLOADS))
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
