"""partition_data_parallel: groups whole on one rank, ranks balanced by computed cost, equal
counts, padding samples, mini-batch boundaries, the same partition in every process."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, build_plan, prompt_groups
from prefix_sharing.batching import computed_cost, partition_data_parallel, sharing_groups
from prefix_sharing.errors import InputError
from tests.batching.batches import grpo_batch, tree_batch
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
PROMPT_ONLY = PrefixSharingConfig(mode="prompt_only")


def ranks_of(partition, members):
    return {r for r, p in enumerate(partition.partitions) for i in p if i in set(members)}


def check_rank_figures(partition, sequences, config=PrefixSharingConfig(), uids=None,
                       prompt_lens=None, num_padding=0):
    """Each rank's figures are those of its part of each sharing group, planned alone (the
    ``num_padding`` padding samples at the end of the batch each alone)."""
    real = len(sequences) - num_padding
    groups = sharing_groups(sequences[:real], config, None if uids is None else uids[:real])
    groups += [[i] for i in range(real, len(sequences))]
    for r, p in enumerate(partition.partitions):
        tokens, cost = 0, 0.0
        for group in groups:
            part = sorted(set(group) & set(p))
            if not part:
                continue
            part_groups = None
            if config.mode == "prompt_only":
                part_groups = prompt_groups([uids[i] for i in part], [prompt_lens[i] for i in part])
            plan = build_plan([sequences[i] for i in part], config, groups=part_groups)
            tokens, cost = tokens + plan.num_tokens_unique, cost + computed_cost(plan)
        assert partition.tokens_computed[r] == tokens
        assert partition.tokens_total[r] == sum(len(sequences[i]) for i in p)
        assert partition.cost[r] == pytest.approx(cost, rel=1e-12)


# --------------------------------------------------------------------------- issue 29's figures
DONE_WHEN = {
    "grpo arbitrary_prefix": lambda: (*grpo_batch()[:2], None, PrefixSharingConfig()),
    "grpo prompt_only": lambda: (*grpo_batch(), PROMPT_ONLY),
    "tree batch": lambda: (tree_batch(), None, None, PrefixSharingConfig()),
}


@pytest.mark.parametrize("name", DONE_WHEN)
def test_issue_29_figures_at_dp_8(name):
    sequences, uids, prompt_lens, config = DONE_WHEN[name]()
    partition = partition_data_parallel(sequences, 8, config, uids=uids, prompt_lens=prompt_lens)

    assert sorted(partition.order) == list(range(512)), "no sample lost or duplicated"
    assert [len(p) for p in partition.partitions] == [64] * 8
    groups = sharing_groups(sequences, config, uids)
    assert all(len(ranks_of(partition, g)) == 1 for g in groups), "every group on one rank"
    assert partition.groups_split == 0 and partition.num_groups == len(groups)
    assert partition.cost_imbalance <= 1.05
    assert partition.token_ratio >= 0.98 * partition.ideal_token_ratio
    check_rank_figures(partition, sequences, config, uids, prompt_lens)


@pytest.mark.parametrize("config, uids", [
    (PrefixSharingConfig(mode="off"), None),  # 512 groups of one
    (PrefixSharingConfig(), list(range(512))),
])
def test_512_groups_of_one_are_balanced(config, uids):
    sequences = grpo_batch()[0]
    partition = partition_data_parallel(sequences, 8, config, uids=uids)
    assert sorted(partition.order) == list(range(512)) and partition.groups_split == 0
    assert partition.cost_imbalance <= 1.05


def test_sharing_aware_ranks_compute_what_each_group_alone_computes():
    sequences, uids, _ = grpo_batch()
    partition = partition_data_parallel(sequences, 8, uids=uids)
    per_group = sum(build_plan([sequences[i] for i in g]).num_tokens_unique
                    for g in sharing_groups(sequences, PrefixSharingConfig(), uids))
    assert partition.ideal_tokens_computed == per_group == sum(partition.tokens_computed)
    assert partition.ideal_token_ratio > 1.3


def test_verls_stock_partition_computes_more():
    seqlen_balancing = pytest.importorskip(
        "verl.utils.seqlen_balancing", reason="the stock comparison needs verl")
    import torch

    sequences, uids, _ = grpo_batch()
    workloads = seqlen_balancing.calculate_workload(torch.tensor([len(s) for s in sequences]))
    stock = seqlen_balancing.get_seqlen_balanced_partitions(workloads, 8, equal_size=True)
    stock_computed = sum(build_plan([sequences[i] for i in p]).num_tokens_unique for p in stock)
    ours = partition_data_parallel(sequences, 8, uids=uids)
    assert sum(ours.tokens_computed) < stock_computed
    assert sum(ours.tokens_total) / stock_computed < 0.9 * ours.token_ratio


def test_metrics_name_what_a_trainer_logs():
    sequences, uids, _ = grpo_batch()
    partition = partition_data_parallel(sequences, 8, uids=uids)
    metrics = partition.metrics()
    total = sum(partition.tokens_total)
    assert metrics == {
        "prefix_sharing/dp_token_ratio": total / sum(partition.tokens_computed),
        "prefix_sharing/dp_ideal_token_ratio": total / partition.ideal_tokens_computed,
        "prefix_sharing/dp_cost_imbalance": max(partition.cost) / (sum(partition.cost) / 8),
        "prefix_sharing/dp_groups_split": 0.0,
    }
    assert partition.order == [i for p in partition.partitions for i in p]
    assert set(partition.metrics("x/")) == {k.replace("prefix_sharing/", "x/") for k in metrics}


# --------------------------------------------------------------------------- counts and cuts
def test_when_whole_groups_cannot_give_equal_counts_the_fewest_are_cut():
    sequences, uids, _ = grpo_batch()
    sequences, uids = sequences[:480], uids[:480]  # 60 groups of 8 over 8 ranks of 60
    partition = partition_data_parallel(sequences, 8, uids=uids)
    assert [len(p) for p in partition.partitions] == [60] * 8
    assert sorted(partition.order) == list(range(480))
    # 7.5 groups a rank: four groups cut in two, the rest whole
    assert partition.groups_split == 4
    cut = [g for g in sharing_groups(sequences, PrefixSharingConfig(), uids)
           if len(ranks_of(partition, g)) > 1]
    assert len(cut) == 4 and all(len(ranks_of(partition, g)) == 2 for g in cut)
    assert partition.cost_imbalance <= 1.05


def test_a_cut_tree_parts_at_its_shallowest_branch():
    # one tree: two sub-trees of 3 under a 20-token prompt, each sub-tree sharing 10 more
    prompt = list(range(1, 21))
    subtree = [[prompt + [100 + s] * 10 + [200 + 10 * s + k] for k in range(3)] for s in range(2)]
    other = [[300 + k] * 5 for k in range(2)]
    sequences = subtree[0] + subtree[1] + other  # 8 samples, 2 ranks of 4
    partition = partition_data_parallel(sequences, 2, EVERY_PREFIX)
    assert partition.groups_split == 1
    assert {frozenset(p) for p in partition.partitions} == {
        frozenset({0, 1, 2, 6}), frozenset({3, 4, 5, 7})}


def test_without_equal_size_groups_stay_whole_and_ranks_may_differ_in_count():
    sequences, uids, _ = grpo_batch()
    sequences, uids = sequences[:480], uids[:480]
    partition = partition_data_parallel(sequences, 8, uids=uids, equal_size=False)
    assert partition.groups_split == 0
    assert sorted(partition.order) == list(range(480))
    assert partition.cost_imbalance <= 1.05
    few = partition_data_parallel([[1, 2], [3, 4]], 4, equal_size=False)
    assert sorted(len(p) for p in few.partitions) == [0, 0, 1, 1]


def test_padding_samples_join_no_group_and_fill_counts():
    sequences, uids, _ = grpo_batch()
    sequences, uids = sequences[:504], uids[:504]  # 63 groups, padded to 512 as verl does
    pad = [2] * 128  # verl's synthetic padding sample: SYNTHETIC_PADDING_SEQ_LEN tokens
    sequences = sequences + [pad] * 8
    uids = uids + ["pad"] * 8  # verl gives every padding sample one uid
    padding = [False] * 504 + [True] * 8
    partition = partition_data_parallel(sequences, 8, uids=uids, padding=padding)
    assert [len(p) for p in partition.partitions] == [64] * 8
    assert sorted(partition.order) == list(range(512))
    assert partition.groups_split == 0 and partition.num_groups == 63
    pad_ranks = ranks_of(partition, range(504, 512))
    assert len(pad_ranks) == 1  # the rank with 7 groups takes all 8
    assert partition.ideal_tokens_computed == sum(
        build_plan([sequences[i] for i in g]).num_tokens_unique
        for g in sharing_groups(sequences[:504], PrefixSharingConfig(), uids[:504])) + 8 * 128
    check_rank_figures(partition, sequences, uids=uids, num_padding=8)

    # 61 groups and 4 padding samples over 6 ranks of 82 (10 groups and 2 more each): the
    # padding fills two ranks' gaps, one group cut in four fills the other four
    uneven = partition_data_parallel(sequences[:488] + [pad] * 4, 6,
                                     uids=uids[:488] + ["pad"] * 4,
                                     padding=[False] * 488 + [True] * 4)
    assert [len(p) for p in uneven.partitions] == [82] * 6
    assert uneven.groups_split == 1


# --------------------------------------------------------------------------- mini-batches
def test_mini_batches_hold_whole_groups_where_an_order_allows():
    sizes = [3, 2, 5, 6]  # in batch order, runs of 8 would cut the group of 5
    sequences, uids = [], []
    for g, size in enumerate(sizes):
        sequences += [[1000 * (g + 1)] * 9 + [k] for k in range(size)]
        uids += [g] * size
    partition = partition_data_parallel(sequences, 1, uids=uids, mini_batch_size=8)
    order = partition.partitions[0]
    runs = [set(uids[i] for i in order[:8]), set(uids[i] for i in order[8:])]
    assert runs[0].isdisjoint(runs[1]) and partition.mini_batch_groups_split == 0
    assert sorted(order) == list(range(16))


def test_a_mini_batch_boundary_cuts_a_group_only_when_no_order_avoids_it():
    sizes = [3, 3, 3, 3, 4]  # no set of them makes 8
    sequences, uids = [], []
    for g, size in enumerate(sizes):
        sequences += [[1000 * (g + 1)] * 9 + [k] for k in range(size)]
        uids += [g] * size
    partition = partition_data_parallel(sequences, 1, uids=uids, mini_batch_size=8)
    assert sorted(partition.order) == list(range(16))
    assert partition.mini_batch_groups_split == 1


def test_grpo_mini_batches_of_two_groups_per_rank_cut_nothing():
    sequences, uids, _ = grpo_batch()
    partition = partition_data_parallel(sequences, 8, uids=uids, mini_batch_size=16)
    assert partition.mini_batch_groups_split == 0 and partition.groups_split == 0
    for p in partition.partitions:
        runs = [{uids[i] for i in p[k:k + 16]} for k in range(0, 64, 16)]
        assert all(len(run) == 2 for run in runs)
        costs = [computed_cost(build_plan([sequences[i] for i in p[k:k + 16]]))
                 for k in range(0, 64, 16)]
        assert costs == sorted(costs, reverse=True), "each rank's costliest mini-batch first"
    assert partition.cost_imbalance <= 1.05


# --------------------------------------------------------------------------- determinism
_IN_ANOTHER_PROCESS = """
import json, sys
from prefix_sharing.batching import partition_data_parallel, split_micro_batches
from tests.batching.batches import grpo_batch, tree_batch
sequences, uids, _ = grpo_batch()
trees = tree_batch()
print(json.dumps([
    partition_data_parallel(sequences, 8, uids=uids, mini_batch_size=16).partitions,
    partition_data_parallel(trees, 8).partitions,
    split_micro_batches(sequences, 8192, uids=uids, min_micro_batches=4).micro_batches,
    split_micro_batches(trees, 4096).micro_batches,
]))
"""


def test_every_process_builds_the_same_partition_and_micro_batches():
    """String uids and hash seeds: nothing depends on hash or set order."""
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", _IN_ANOTHER_PROCESS], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1]
    assert len(outputs[0][0]) == 8 and len(outputs[0][2]) >= 4


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("sequences, kwargs, message", [
    ([[1]] * 4, dict(dp_size=0), "dp_size must be an integer >= 1; got 0"),
    ([[1]] * 3, dict(dp_size=4), "every one of dp_size=4 ranks a sample, but the batch has only 3"),
    ([[1]] * 6, dict(dp_size=4), "6 samples do not divide over dp_size=4: pad the batch"),
    ([[1]] * 8, dict(dp_size=2, mini_batch_size=3), "mini_batch_size=3 .* does not divide the 4"),
    ([[1]] * 8, dict(dp_size=2, equal_size=False, mini_batch_size=2),
     "mini_batch_size needs equal_size=True"),
    ([[1]] * 8, dict(dp_size=2, config=PROMPT_ONLY, uids=list(range(8))),
     "prompt_only.*pass uids= and prompt_lens="),
    ([[1]] * 8, dict(dp_size=2, uids=[0, 1]), "2 uids for a batch of 8 sequences"),
    ([[1]] * 8, dict(dp_size=2, padding=[True]), "1 padding for a batch of 8 sequences"),
    ([], dict(dp_size=2), "needs at least one sequence"),
])
def test_bad_input_is_one_clear_error(sequences, kwargs, message):
    with pytest.raises(InputError, match=message):
        partition_data_parallel(sequences, **kwargs)


# --------------------------------------------------------------------------- any batch
@settings(max_examples=120, deadline=None)
@given(seqs=forests(max_sequences=16), dp=st.integers(1, 4), use_uids=st.booleans(),
       equal_size=st.booleans(), data=st.data())
def test_every_sample_once_counts_equal_and_figures_those_of_the_ranks_group_parts(
        seqs, dp, use_uids, equal_size, data):
    n = len(seqs) - len(seqs) % dp if equal_size else len(seqs)
    if n == 0:
        seqs, n = seqs * dp, len(seqs) * dp
    seqs = seqs[:n]
    uids = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) if use_uids else None
    padding = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    per_rank = n // dp
    mini_batch_size = data.draw(st.sampled_from(
        [None] + [m for m in range(1, per_rank + 1) if per_rank % m == 0])) if equal_size else None
    partition = partition_data_parallel(seqs, dp, EVERY_PREFIX, uids=uids, equal_size=equal_size,
                                        padding=padding, mini_batch_size=mini_batch_size)

    assert sorted(partition.order) == list(range(n))
    if equal_size:
        assert {len(p) for p in partition.partitions} == {n // dp}
    real = [i for i in range(n) if not padding[i]]
    groups = [] if not real else [[real[j] for j in g] for g in sharing_groups(
        [seqs[i] for i in real], EVERY_PREFIX, None if uids is None else [uids[i] for i in real])]
    split = sum(len(ranks_of(partition, g)) > 1 for g in groups)
    assert partition.groups_split == split and partition.num_groups == len(groups)
    if not equal_size:
        assert split == 0
    alone = [[i] for i in range(n) if padding[i]]
    for r, p in enumerate(partition.partitions):
        parts = [sorted(set(g) & set(p)) for g in groups + alone]
        computed = sum(build_plan([seqs[i] for i in part], EVERY_PREFIX).num_tokens_unique
                       for part in parts if part)
        assert partition.tokens_computed[r] == computed
    assert sum(partition.tokens_computed) >= partition.ideal_tokens_computed
