"""``engines.megatron.compare``: runs that do not hold the same things never compare as equal.

The runs are built by hand (no megatron needed): the comparison alone is under test. That
``verify`` fails end to end when the shared run drops a micro-batch's outputs is in
``tests/megatron_ext/test_verdict.py``.
"""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.engines.megatron import MicroBatchRun, compare
from prefix_sharing.equivalence import RunOutputs


def _outputs(tokens: int, shift: float = 0.0) -> RunOutputs:
    base = torch.linspace(1.0, 2.0, tokens)
    return RunOutputs(base[:, None].expand(tokens, 8) + shift, -base + shift, base + shift,
                      base.sum() + shift, {})


def _run(*tokens: int, grads: dict | None = None, shift: float = 0.0) -> MicroBatchRun:
    grads = {"w": torch.ones(3) + shift} if grads is None else grads
    return MicroBatchRun([_outputs(n, shift) for n in tokens], grads, [])


def test_equal_runs_compare_as_equal_and_a_difference_shows():
    assert set(compare(_run(5, 7), _run(5, 7)).max_rel_diff.values()) == {0.0}
    moved = compare(_run(5, 7, shift=1e-3), _run(5, 7)).max_abs_diff
    assert all(d == pytest.approx(1e-3, rel=1e-2) for d in moved.values())


def test_a_run_that_dropped_a_micro_batch_fails():
    with pytest.raises(AssertionError, match="outputs of 1 vs 2 micro-batches"):
        compare(_run(5), _run(5, 7))
    with pytest.raises(AssertionError, match="outputs of 0 vs 2 micro-batches"):
        compare(_run(), _run(5, 7))


def test_outputs_of_another_shape_fail():
    with pytest.raises(AssertionError, match=r"shapes differ: \(6, 8\) vs \(7, 8\)"):
        compare(_run(5, 6), _run(5, 7))


def test_other_gradients_fail():
    with pytest.raises(AssertionError, match=r"gradients for different names: \['v'\]"):
        compare(_run(5, grads={"w": torch.ones(3), "v": torch.ones(1)}), _run(5))
    with pytest.raises(AssertionError, match="shapes differ"):
        compare(_run(5, grads={"w": torch.ones(4)}), _run(5))


def test_an_empty_comparison_fails():
    with pytest.raises(AssertionError, match="empty comparison"):
        compare(_run(grads={}), _run(grads={}))
    with pytest.raises(AssertionError, match="empty comparison"):
        compare(_run(0), _run(0))


def test_an_inner_pipeline_stage_compares_its_gradients():
    """A stage without the loss holds no outputs in either run: its gradients still count."""
    result = compare(_run(shift=0.5), _run())
    assert result.max_abs_diff["grads"] == 0.5 and result.max_abs_diff["logits"] == 0.0
