"""The verdict rule of ``verify``: a multiple of the plain run's own error, plus a floor."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.equivalence import (
    DEFAULT_LOW_PRECISION_FACTOR,
    FP32_RTOL,
    LOW_PRECISION_FACTOR,
    QUANTITIES,
    SCALAR_FLOOR_ULPS,
    SCALAR_QUANTITIES,
    TENSOR_FLOOR_ULPS,
    Comparison,
    RunOutputs,
    allowed_rel_diff,
    compare_pairs,
    compare_runs,
    within_tolerance,
)


def comparison(**rel: float) -> Comparison:
    """A comparison with these relative differences (others 0); absolute ones unused."""
    diffs = {q: rel.get(q, 0.0) for q in QUANTITIES}
    return Comparison(max_abs_diff=dict(diffs), max_rel_diff=diffs)


def factor(q: str) -> float:
    return LOW_PRECISION_FACTOR.get(q, DEFAULT_LOW_PRECISION_FACTOR)


def test_without_a_plain_run_the_fixed_fp32_rule_applies():
    verdict = within_tolerance(comparison(logits=FP32_RTOL, grads=1.01 * FP32_RTOL))
    assert verdict["logits"] and not verdict["grads"]


def test_fp32_run_as_far_from_float64_as_the_plain_fp32_run_passes_at_scale():
    """The false alarm of a large agent batch: grads 1.1e-5 from the plain fp32 run, which is
    itself 6e-6 from float64 - summation order, not a bug."""
    plain = comparison(logits=3e-6, log_probs=1e-6, entropy=1e-6, loss=1e-7, grads=6e-6)
    shared = comparison(logits=3e-6, log_probs=1e-6, entropy=1e-6, loss=1e-7, grads=1.1e-5)
    assert all(within_tolerance(shared, plain, torch.float32).values())
    assert not within_tolerance(shared)["grads"]  # the fixed rule called it a failure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", QUANTITIES)
def test_each_quantity_fails_just_beyond_its_allowance(dtype, q):
    plain = comparison(**{k: 1e-3 for k in QUANTITIES})
    allowed = allowed_rel_diff(plain, dtype)[q]
    assert within_tolerance(comparison(**{q: allowed}), plain, dtype)[q]
    assert not within_tolerance(comparison(**{q: allowed * 1.001}), plain, dtype)[q]


def test_allowance_is_the_factor_times_the_plain_error_plus_a_floor_in_ulps():
    plain = comparison(logits=1e-3, grads=1e-3, loss=1e-3)
    for dtype in (torch.float32, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        allowed = allowed_rel_diff(plain, dtype)
        assert allowed["logits"] == pytest.approx(factor("logits") * 1e-3 + TENSOR_FLOOR_ULPS * eps)
        assert allowed["grads"] == pytest.approx(factor("grads") * 1e-3 + TENSOR_FLOOR_ULPS * eps)
        assert allowed["loss"] == pytest.approx(factor("loss") * 1e-3 + SCALAR_FLOOR_ULPS * eps)
    assert factor("grads") > factor("logits")  # gradients accumulate more rounding


def test_a_scalar_the_plain_bf16_run_got_exactly_right_may_still_be_a_few_ulps_off():
    """The loss is one number: its plain bf16 error is one sample of the rounding noise, and
    may happen to be 0. A correct kernel's loss a couple of bf16 ulps away still passes."""
    assert SCALAR_QUANTITIES == ("loss",)
    plain = comparison(logits=1e-2, log_probs=1e-2, entropy=1e-2, loss=0.0, grads=1e-2)
    bf16_ulp = torch.finfo(torch.bfloat16).eps
    assert within_tolerance(comparison(loss=2 * bf16_ulp), plain)["loss"]
    assert not within_tolerance(comparison(loss=2 * SCALAR_FLOOR_ULPS * bf16_ulp), plain)["loss"]


def test_a_tensor_the_plain_run_got_exactly_right_allows_only_a_sliver():
    plain = comparison()  # every difference 0
    for dtype in (torch.float32, torch.bfloat16):
        sliver = TENSOR_FLOOR_ULPS * torch.finfo(dtype).eps
        assert sliver <= 1e-5  # no looser than the fixed bf16 floor it replaced
        assert within_tolerance(comparison(logits=sliver), plain, dtype)["logits"]
        assert not within_tolerance(comparison(logits=2 * sliver), plain, dtype)["logits"]


def _run_outputs(tokens: int, grads: dict) -> RunOutputs:
    x = torch.linspace(1.0, 2.0, tokens)
    return RunOutputs(x[:, None].expand(tokens, 4), x, x, x.sum(), grads)


def test_compare_runs_fails_on_other_shapes_names_or_nothing():
    grads = {"w": torch.ones(2)}
    assert compare_runs(_run_outputs(3, grads), _run_outputs(3, grads)).max_abs_diff["loss"] == 0
    with pytest.raises(AssertionError, match="shapes differ"):
        compare_runs(_run_outputs(2, grads), _run_outputs(3, grads))
    with pytest.raises(AssertionError, match=r"different names: \['v'\]"):
        compare_runs(_run_outputs(3, {**grads, "v": torch.ones(1)}), _run_outputs(3, grads))
    with pytest.raises(AssertionError, match="empty comparison"):
        compare_runs(_run_outputs(0, grads), _run_outputs(0, grads))
    with pytest.raises(AssertionError, match="empty comparison"):
        compare_pairs({q: [] for q in QUANTITIES})
