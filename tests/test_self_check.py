"""The first-step self-check's judgement: figures per quantity, the bound per dtype, the error."""

import pytest
import torch

from prefix_sharing.equivalence import FP32_RTOL
from prefix_sharing.self_check import (SelfCheckFailed, compare_with_stock,
                                       self_check_bound)


def samples(*lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [-torch.rand(n, generator=gen) * 5 for n in lengths]


def outputs(log_probs, entropy=None):
    as_nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    found = {"log_probs": as_nested(log_probs)}
    if entropy is not None:
        found["entropy"] = as_nested(entropy)
    return found


def test_the_bound_is_the_project_fp32_rule_and_torchs_documented_low_precision_rtol():
    assert self_check_bound(torch.float32) == FP32_RTOL == 1e-5
    assert self_check_bound(torch.bfloat16) == 1.6e-2  # torch.testing.assert_close's defaults
    assert self_check_bound(torch.float16) == 1e-3
    assert self_check_bound(torch.float64) == FP32_RTOL


def test_equal_outputs_pass_with_zero_figures_for_both_quantities():
    lp, ent = samples(5, 3), samples(5, 3, seed=1)
    result = compare_with_stock(outputs(lp, ent), outputs(lp, ent), torch.float32)
    assert result.passed
    assert result.max_abs_diff == result.max_rel_diff == {"log_probs": 0.0, "entropy": 0.0}
    assert result.as_metrics() == {"prefix_sharing/self_check_max_abs_diff": 0.0,
                                   "prefix_sharing/self_check_max_rel_diff": 0.0,
                                   "prefix_sharing/self_check_bound": 1e-5}
    result.raise_if_beyond()


def test_figures_are_relative_to_the_stock_sides_largest_magnitude():
    stock = [torch.tensor([-4.0, -1.0, 0.0]), torch.tensor([-2.0, 0.0])]
    shared = [torch.tensor([-4.0, -1.5, 0.0]), torch.tensor([-2.0, 0.0])]
    result = compare_with_stock(outputs(shared), outputs(stock), torch.bfloat16)
    assert result.max_abs_diff == {"log_probs": 0.5}  # no entropy asked for: not compared
    assert result.max_rel_diff == {"log_probs": 0.125}
    assert not result.passed


def test_each_samples_last_log_prob_predicts_nothing_and_is_not_compared():
    stock = samples(4, 2)
    shared = [s.clone() for s in stock]
    for s in shared:
        s[-1] = 0.0  # the shared path's value there; verl's reads a wrapped-around label
    assert compare_with_stock(outputs(shared), outputs(stock), torch.float32).passed


def test_a_difference_at_the_fp32_bound_passes_and_just_beyond_it_fails():
    stock = [torch.tensor([-8.0, -2.0, -1.0, 0.0])]
    within = [torch.tensor([-8.0, -2.0 + 7e-5, -1.0, 0.0])]  # 7e-5 / 8 < 1e-5
    beyond = [torch.tensor([-8.0, -2.0 + 9e-5, -1.0, 0.0])]  # 9e-5 / 8 > 1e-5
    assert compare_with_stock(outputs(within), outputs(stock), torch.float32).passed
    result = compare_with_stock(outputs(beyond), outputs(stock), torch.float32)
    assert not result.passed
    assert compare_with_stock(outputs(beyond), outputs(stock), torch.bfloat16).passed


def test_beyond_the_bound_raises_with_the_figures_and_the_bound():
    lp = samples(6)
    entropy = samples(6, seed=3)
    wrong = [e + 0.5 for e in entropy]
    result = compare_with_stock(outputs(lp, wrong), outputs(lp, entropy), torch.bfloat16)
    with pytest.raises(SelfCheckFailed) as error:
        result.raise_if_beyond()
    message = str(error.value)
    assert "entropy: max abs diff 5.000e-01" in message
    assert f"max rel diff {0.5 / entropy[0].abs().max().item():.3e}" in message
    assert "BEYOND the bound 1.6e-02 relative" in message and "torch.bfloat16" in message


def test_sides_that_hold_different_samples_or_shapes_never_compare_as_equal():
    with pytest.raises(ValueError):  # zip(strict=True): one sample more on one side
        compare_with_stock(outputs(samples(3, 2)), outputs(samples(3)), torch.float32)
    with pytest.raises(AssertionError, match="shapes differ"):
        compare_with_stock(outputs(samples(3, 2)), outputs(samples(3, 3)), torch.float32)
    with pytest.raises(AssertionError, match="no log_probs"):
        compare_with_stock(outputs(samples(3)), {}, torch.float32)
