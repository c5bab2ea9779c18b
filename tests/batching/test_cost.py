"""The cost model: computed tokens plus attended pairs, proportional to count_flops' FLOPs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.batching import CostModel, computed_cost, split_micro_batches
from prefix_sharing.errors import InputError
from prefix_sharing.flops import count_flops
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import make_workload
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
PLAIN = PrefixSharingConfig(mode="off")


@pytest.mark.parametrize("length", [1, 7, 1000, 4096])
def test_a_plain_sequence_costs_verls_calculate_workload_over_24576(length):
    # verl: 24576 * L + L**2; the cost counts the L * (L + 1) / 2 causal pairs, twice over
    cost = computed_cost(build_plan([list(range(length))]))
    assert cost * 24576 == pytest.approx(24576 * length + length**2 + length, rel=1e-12)
    assert CostModel().plain(length) == pytest.approx(cost, rel=1e-12)


def test_a_shared_prefix_is_charged_once_and_its_keys_to_every_reader():
    prompt, tails = list(range(100)), [[1000 + k] * 10 for k in range(3)]
    plan = build_plan([prompt + t for t in tails], EVERY_PREFIX)
    tokens = 100 + 3 * 10
    pairs = 100 * 101 // 2 + 3 * (10 * 100 + 10 * 11 // 2)  # the prompt, then each tail
    assert computed_cost(plan) == pytest.approx(tokens + pairs / 12288)
    assert computed_cost(plan, CostModel(keys_per_token=1.0)) == tokens + pairs


@given(forests(max_sequences=8), forests(max_sequences=8),
       st.sampled_from(["qwen2.5-0.5b", "tiny-moe", "small-mla", "small-hybrid",
                        "tiny-nemotron-h"]))
def test_cost_for_a_model_is_proportional_to_its_forward_flops(seqs_a, seqs_b, preset):
    model = get_preset(preset)
    cost_model = CostModel.for_model(model)
    a, b = build_plan(seqs_a, EVERY_PREFIX), build_plan(seqs_b, EVERY_PREFIX)
    flops_a, flops_b = count_flops(a, model), count_flops(b, model)
    assert computed_cost(a, cost_model) / computed_cost(b, cost_model) == pytest.approx(
        flops_a.shared / flops_b.shared, rel=1e-9)
    # and the plain forward: the same batch planned with nothing shared
    plain_a = build_plan(seqs_a, PLAIN)
    assert computed_cost(plain_a, cost_model) / computed_cost(a, cost_model) == pytest.approx(
        flops_a.ratio, rel=1e-9)


def test_windowed_attention_is_not_modelled():
    with pytest.raises(InputError, match="sliding-window attention is not modelled"):
        CostModel.for_model(get_preset("tiny-window"))
    with pytest.raises(InputError, match="keys_per_token must be > 0"):
        CostModel(keys_per_token=0)


def test_micro_batches_are_balanced_by_cost_not_tokens():
    # one 2000-token sequence (cost 2162.9), 20 x 105 tokens (2109.1), 20 x 100 (2008.2):
    # three uid groups sharing nothing; by tokens the long one would join the 20 x 100, by
    # cost it runs alone
    long = [list(range(1, 2001))]
    mid = [[10_000 + k] * 105 for k in range(20)]
    short = [[20_000 + k] * 100 for k in range(20)]
    uids = [0] + [1] * 20 + [2] * 20
    split = split_micro_batches(long + mid + short, 100_000, uids=uids, min_micro_batches=2)
    assert split.micro_batches == ((0,), tuple(range(1, 41)))
    assert split.tokens_computed == (2000, 20 * 105 + 20 * 100)


def test_the_token_budget_still_bounds_computed_tokens():
    w = make_workload("grpo")
    split = split_micro_batches(w.sequences, 60, EVERY_PREFIX)
    assert max(split.tokens_computed) <= 60
