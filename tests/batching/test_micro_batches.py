"""split_micro_batches: every sample once, groups together, the budget in computed tokens."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.batching import split_fixed_micro_batches, split_micro_batches
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


# --- a fixed sample count per micro-batch (verl without dynamic batch size) -----------------

def groups_cut(split, uids):
    """Uid groups whose members sit in more than one micro-batch (counted independently)."""
    where = {i: m for m, mb in enumerate(split.micro_batches) for i in mb}
    return sum(len({where[i] for i, u in enumerate(uids) if u == g}) > 1 for g in set(uids))


@pytest.mark.parametrize("uids, size, micro_batches, cut", [
    # interleaved pairs: verl's chunks [0 1][2 3] cut both groups, the packing none
    (["a", "b", "a", "b"], 2, ((0, 2), (1, 3)), 0),
    # groups of 3, 3, 1, 1 into micro-batches of 4: each 3 beside a 1
    (["a", "b", "a", "b", "a", "b", "c", "d"], 4, ((0, 2, 4, 6), (1, 3, 5, 7)), 0),
    # groups of 3, 2, 2, 1 into micro-batches of 4: the 2s together, the 3 with the 1
    (["a", "b", "c", "a", "b", "c", "a", "d"], 4, ((0, 3, 6, 7), (1, 2, 4, 5)), 0),
    # a group larger than the size fills micro-batches whole and is counted once
    (["a"] * 5 + ["b"] * 3, 4, None, 1),
])
def test_fixed_size_micro_batches_keep_groups_whole_where_an_order_allows(
        uids, size, micro_batches, cut):
    seqs = [[1, 2, i] for i in range(len(uids))]
    split = split_fixed_micro_batches(seqs, size, EVERY_PREFIX, uids=uids)
    assert all(len(mb) == size for mb in split.micro_batches)
    assert sorted(split.order) == list(range(len(uids)))
    if micro_batches is not None:
        assert split.micro_batches == micro_batches
    assert split.groups_split == cut == groups_cut(split, uids)
    assert split.token_budget == 0 and split.oversized == ()


def test_fixed_size_keeps_the_batch_order_unless_packing_cuts_or_computes_less():
    # GRPO groups of 3 in micro-batches of 2: every order cuts both; verl's chunks stay
    uids = ["a"] * 3 + ["b"] * 3
    split = split_fixed_micro_batches([[1, i] for i in range(6)], 2, uids=uids)
    assert split.micro_batches == ((0, 1), (2, 3), (4, 5)) and split.groups_split == 2
    kept = split_fixed_micro_batches([[1, i] for i in range(4)], 2, uids=list("aabb"))
    assert kept.order == [0, 1, 2, 3] and kept.groups_split == 0


def test_fixed_size_cuts_an_oversized_tree_between_its_sub_trees():
    w = make_workload("tree", depth=3, branching=2)  # 10 samples: two sub-trees of 5
    split = split_fixed_micro_batches(w.sequences, 5)
    assert split.micro_batches == ((0, 1, 2, 3, 9), (4, 5, 6, 7, 8))
    assert split.groups_split == 1  # as verl's chunks [0-4][5-9], which compute more
    chunks = [computed(w.sequences, range(s, s + 5)) for s in (0, 5)]
    assert sum(split.tokens_computed) < sum(chunks)


def test_fixed_size_must_divide_the_batch():
    with pytest.raises(ValueError, match="a micro-batch size of 2 does not divide the batch of 3"):
        split_fixed_micro_batches([[1, 2], [1, 3], [4]], 2)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8), size=st.integers(1, 6),
       seed=st.integers(0, 1000))
def test_fixed_size_every_sample_once_and_never_more_cuts_than_verls_chunks(sizes, size, seed):
    import random

    uids = [g for g, k in enumerate(sizes) for _ in range(k)]
    uids += [len(sizes) + i for i in range(-len(uids) % size)]  # singletons make it divide
    random.Random(seed).shuffle(uids)
    seqs = [[u, 7, i] for i, u in enumerate(uids)]
    split = split_fixed_micro_batches(seqs, size, EVERY_PREFIX, uids=uids)
    assert sorted(split.order) == list(range(len(uids)))
    assert all(len(mb) == size for mb in split.micro_batches)
    assert split.groups_split == groups_cut(split, uids)
    chunks = SimpleNamespace(micro_batches=[tuple(range(s, s + size))
                                            for s in range(0, len(uids), size)])
    assert split.groups_split <= groups_cut(chunks, uids)
    # each group of at most ``size`` fits one micro-batch: with as many micro-batches as
    # groups, at most the groups larger than the size are cut when they divide evenly
    if all(size % k == 0 for k in sizes) and len(uids) == sum(sizes):
        assert split.groups_split == 0
