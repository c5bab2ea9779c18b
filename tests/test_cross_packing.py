"""Suffix micro-batch boundaries: the fewest pieces the budget allows, placed at equal cost."""

import pytest
import torch

from prefix_sharing.batching.cost import CostModel
from prefix_sharing.cross_micro_batch import plan_group
from prefix_sharing.cross_packing import pack_at_equal_cost


def pack(tokens, costs, budget):
    """Units ``0 .. n-1`` with the given tokens and costs (additive, as at one depth)."""
    units = [[i] for i in range(len(tokens))]
    pieces = pack_at_equal_cost(units, lambda m: sum(tokens[i] for i in m) <= budget,
                                lambda m: sum(costs[i] for i in m))
    assert [i for p in pieces for i in p] == list(range(len(tokens)))  # contiguous, in order
    assert all(sum(tokens[i] for i in p) <= budget for p in pieces)  # the hard bound
    return pieces


def test_equal_tokens_are_split_evenly_where_a_greedy_fill_would_not():
    # a greedy fill by tokens gives [0, 1, 2] (9) and [3] (3): the same count, unequal cost
    assert pack([3, 3, 3, 3], [3, 3, 3, 3], budget=9) == [[0, 1], [2, 3]]


def test_cost_not_tokens_places_the_boundary():
    # equal tokens, the last unit costly (a tail attending many keys): it goes alone
    assert pack([3, 3, 3, 3], [1, 1, 1, 5], budget=9) == [[0, 1, 2], [3]]
    # control: with costs equal to tokens the same units split 2 + 2
    assert pack([3, 3, 3, 3], [3, 3, 3, 3], budget=9) != [[0, 1, 2], [3]]


def test_the_count_grows_only_where_equal_cost_would_break_the_budget():
    # two pieces by tokens ([0, 1], [2, 3]) but unit 0 holds most of the cost: the boundary
    # at half the cost leaves [1, 2, 3] over the budget, so a third piece is taken
    assert pack([3, 3, 3, 3], [10, 1, 1, 1], budget=6) == [[0], [1], [2, 3]]
    assert pack([2, 2, 2, 3, 3], [2, 2, 2, 3, 3], budget=6) == [[0, 1, 2], [3, 4]]


def test_one_piece_when_everything_fits_and_none_for_no_units():
    assert pack([1, 2, 3], [1, 2, 3], budget=6) == [[0, 1, 2]]
    assert pack_at_equal_cost([], lambda m: True, lambda m: 0.0) == []


def test_plan_group_packs_its_suffixes_at_equal_cost():
    """Four branches of 3 tokens under a 9-token budget: two suffixes of 6 computed tokens
    (the greedy fill gave 9 and 3), each branch whole, the prefix once."""
    prefix = list(range(10))
    seqs = [torch.tensor(prefix + [50 + k, 60 + k, 70 + k]) for k in range(4)]
    schedule = plan_group(seqs, token_budget=9)
    assert [s.members for s in schedule.suffixes] == [(0, 1), (2, 3)]
    assert [s.plan.num_tokens_unique for s in schedule.suffixes] == [6, 6]
    assert schedule.tokens_computed == schedule.tokens_distinct == 10 + 12


@pytest.mark.parametrize("keys_per_token", [12288.0, 0.5])
def test_plan_group_suffixes_stay_within_the_budget_whatever_the_cost_ratio(keys_per_token):
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 50, (30,), generator=gen)
    seqs = [torch.cat([prefix, torch.tensor([60 + k]),
                       torch.randint(0, 50, (int(n),), generator=gen)])
            for k, n in enumerate(torch.randint(1, 8, (9,), generator=gen))]
    schedule = plan_group(seqs, token_budget=12, cost_model=CostModel(keys_per_token))
    assert all(s.plan.num_tokens_unique <= 12 for s in schedule.suffixes)
    assert sorted(i for s in schedule.suffixes for i in s.members) == list(range(9))
    assert schedule.tokens_computed == schedule.tokens_distinct
