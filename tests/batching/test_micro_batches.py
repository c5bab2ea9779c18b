"""split_micro_batches: every sample once, groups together, the budget in computed tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.batching import split_micro_batches
from prefix_sharing.workloads import make_workload
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
PLAIN = PrefixSharingConfig(mode="off")


def computed(sequences, members, config=EVERY_PREFIX):
    return build_plan([sequences[i] for i in members], config).num_tokens_unique


def test_grpo_groups_stay_whole_and_fit_more_samples_than_a_plain_split():
    w = make_workload("grpo")  # 3 prompts x 4 responses
    shared = split_micro_batches(w.sequences, 128)
    plain = split_micro_batches(w.sequences, 128, PLAIN)
    for group in w.groups:
        assert any(set(group.members) <= set(mb) for mb in shared.micro_batches)
    assert shared.groups_split == 0 and shared.num_groups == 3
    assert len(shared.micro_batches) < len(plain.micro_batches)
    assert max(shared.tokens_computed) <= 128 and max(plain.tokens_total) <= 128


def test_uids_define_the_groups():
    w = make_workload("grpo")
    uids = [f"u{i % 3}" for i in range(len(w.sequences))]  # interleaved, unlike the prompts
    split = split_micro_batches(w.sequences, 10_000, uids=uids)
    assert split.num_groups == 3 and split.micro_batches == (tuple(range(12)),)
    apart = split_micro_batches(w.sequences, 100, uids=uids, min_micro_batches=3)
    for u in range(3):
        members = [i for i in range(12) if uids[i] == f"u{u}"]
        assert any(set(members) <= set(mb) for mb in apart.micro_batches)


def test_a_tree_over_the_budget_is_cut_at_its_shallowest_branch_and_counted():
    w = make_workload("tree", depth=3, branching=2)  # 8 leaves, a duplicate, an inner path
    whole = computed(w.sequences, range(len(w.sequences)), PrefixSharingConfig())
    split = split_micro_batches(w.sequences, whole - 1)
    assert split.groups_split == 1 and len(split.micro_batches) == 2
    # The two halves are the root's two sub-trees: leaves 0-3 (with the inner path 9)
    # and leaves 4-7 (with the duplicate 8 of leaf 7).
    assert split.micro_batches == ((0, 1, 2, 3, 9), (4, 5, 6, 7, 8))


def test_a_sequence_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    seqs = [[1] * 30, [2] * 5, [3] * 6]
    split = split_micro_batches(seqs, 20)
    assert split.oversized == (0,)
    assert (0,) in split.micro_batches and split.tokens_computed[split.micro_batches.index((0,))] == 30


def test_min_micro_batches_moves_whole_groups_before_splitting_any():
    w = make_workload("grpo")
    split = split_micro_batches(w.sequences, 10_000, min_micro_batches=3)
    assert split.micro_batches == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert split.groups_split == 0
    finer = split_micro_batches(w.sequences, 10_000, min_micro_batches=4)
    assert len(finer.micro_batches) == 4 and finer.groups_split == 1


def test_inverse_restores_the_batch_order():
    w = make_workload("steprl")
    split = split_micro_batches(w.sequences, 60, uids=[i % 2 for i in range(8)])
    outputs = [w.sequences[i] for i in split.order]  # what the micro-batches give back
    restored = [outputs[p] for p in split.inverse]
    assert all(a is b for a, b in zip(restored, w.sequences))


def test_metrics_name_what_a_trainer_logs():
    w = make_workload("grpo")
    split = split_micro_batches(w.sequences, 128)
    metrics = split.metrics()
    assert metrics["prefix_sharing/groups_split"] == 0.0
    assert metrics["prefix_sharing/token_ratio"] == pytest.approx(
        sum(split.tokens_total) / sum(split.tokens_computed))
    assert split.token_ratio > 1.5


@pytest.mark.parametrize("name", ["grpo", "steprl", "tree", "agent"])
def test_shared_micro_batches_carry_more_sequences_than_plain_ones(name):
    w = make_workload(name)
    budget = max(len(s) for s in w.sequences) * 2
    shared = split_micro_batches(w.sequences, budget)
    plain = split_micro_batches(w.sequences, budget, PLAIN)
    assert len(w.sequences) / len(shared.micro_batches) > len(w.sequences) / len(plain.micro_batches)


def test_prompt_only_charges_the_uid_groups_prompts_once():
    w = make_workload("grpo")
    uids = [i // 4 for i in range(12)]
    prompts = [g.prompt_len for g in w.groups for _ in g.members]
    config = PrefixSharingConfig(mode="prompt_only", min_prefix_len=1)
    split = split_micro_batches(w.sequences, 10_000, config, uids=uids, prompt_lens=prompts)
    reused = sum((len(g.members) - 1) * g.prompt_len for g in w.groups)
    assert split.tokens_computed == (w.num_tokens - reused,)
    with pytest.raises(ValueError, match="prompt_only.*uids= and prompt_lens="):
        split_micro_batches(w.sequences, 100, config)


def test_the_split_is_deterministic():
    w = make_workload("agent")
    assert split_micro_batches(w.sequences, 150) == split_micro_batches(w.sequences, 150)


@pytest.mark.parametrize("kwargs, message", [
    (dict(token_budget=0), "token_budget must be an integer >= 1"),
    (dict(token_budget=10, min_micro_batches=4), "min_micro_batches=4 exceeds the batch of 3"),
    (dict(token_budget=10, uids=[0, 1]), "2 uids for a batch of 3 sequences"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_micro_batches([[1, 2], [1, 3], [4]], **kwargs)


@settings(max_examples=150, deadline=None)
@given(seqs=forests(max_sequences=12), budget=st.integers(1, 40), min_mbs=st.integers(1, 4),
       use_uids=st.booleans(), data=st.data())
def test_every_sample_once_budget_honoured_groups_counted(seqs, budget, min_mbs, use_uids, data):
    min_mbs = min(min_mbs, len(seqs))
    uids = data.draw(st.lists(st.integers(0, 3), min_size=len(seqs), max_size=len(seqs))) \
        if use_uids else None
    split = split_micro_batches(seqs, budget, EVERY_PREFIX, uids=uids, min_micro_batches=min_mbs)

    assert sorted(split.order) == list(range(len(seqs)))
    assert [split.order[p] for p in split.inverse] == list(range(len(seqs)))
    assert len(split.micro_batches) >= min_mbs and all(split.micro_batches)
    for mb, tokens in zip(split.micro_batches, split.tokens_computed):
        assert tokens == computed(seqs, mb)
        assert tokens <= budget or len(mb) == 1, "only a lone sequence may exceed the budget"
    assert split.oversized == tuple(i for i, s in enumerate(seqs) if len(s) > budget)
    if uids is not None:
        groups = {u: {i for i in range(len(seqs)) if uids[i] == u} for u in set(uids)}
        kept = sum(any(g <= set(mb) for mb in split.micro_batches) for g in groups.values())
        assert split.num_groups == len(groups) and split.groups_split == len(groups) - kept
