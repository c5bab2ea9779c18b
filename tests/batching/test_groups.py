"""Sharing groups: uid groups, else the planner's prefix trees; components and cut order."""

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.batching.groups import (connected_components, lexicographic_order,
                                            sharing_groups)
from prefix_sharing.workloads import make_workload

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def test_components_are_ordered_by_first_node_with_ascending_members():
    assert connected_components(6, [(5, 1), (3, 4), (1, 0)]) == [[0, 1, 5], [2], [3, 4]]
    assert connected_components(3, []) == [[0], [1], [2]]


def test_uids_make_the_groups_in_order_of_first_appearance():
    seqs = [[1, 2]] * 5
    assert sharing_groups(seqs, EVERY_PREFIX, ["b", "a", "b", 7, "a"]) == [[0, 2], [1, 4], [3]]


def test_without_uids_the_groups_are_the_prefix_trees():
    w = make_workload("grpo")  # 3 prompts x 4 responses
    assert sharing_groups(w.sequences, PrefixSharingConfig()) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert sharing_groups(w.sequences, PrefixSharingConfig(mode="off")) == [
        [i] for i in range(12)]


def test_lexicographic_order_says_how_deep_neighbours_part():
    seqs = [[1, 2, 3, 9], [1, 2, 3, 4], [5], [1, 2, 7]]
    ordered, parting = lexicographic_order([0, 1, 2, 3], seqs)
    assert ordered == [1, 0, 3, 2]
    assert parting == [0, 3, 2, 0]
