"""The first-step self-check: the shared path's log-probs and entropy against the stock path's.

The CUDA and NPU kernels are checked here only against CPU implementations of their documented
semantics, so ``prefix_grouper.self_check: true`` makes a user's first accelerator run the
check: one micro-batch runs both paths on the same weights, and this module judges the result
(the engines' side, which runs them, is :mod:`prefix_sharing.verl_ext.self_check`).

A runtime check has no higher-precision reference, so the flash-attn rule of the equivalence
tests (:mod:`prefix_sharing.equivalence`: the shared run within twice the plain run's own
distance from an fp32 reference) cannot apply. Both paths run in the training dtype; the bound
is a relative one, ``max|shared - stock| / max|stock|`` per quantity, by dtype:

- float32: :data:`~prefix_sharing.equivalence.FP32_RTOL` (1e-5), the project's fp32 rule;
- bfloat16: 1.6e-2 and float16: 1e-3, ``torch.testing.assert_close``'s documented default
  ``rtol`` for those dtypes: about two and three units of their last place (bf16 keeps 8 bits
  of mantissa, fp16 11), the rounding two correct computations of one value may differ by.

What the check is for: a wrong plan, a kernel reading the wrong keys or a wrong restore moves
some log-prob by a sizeable fraction of the batch's largest one; rounding does not. In fp32 it
also catches small errors (on the tests' tiny model, an attention output 5% off gives 4.9e-3);
in bf16, whose rounding alone gave up to 7.3e-3 there, only gross ones. A dtype without an
entry (float64) gets the float32 bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from .equivalence import FP32_RTOL, max_abs_diff, max_rel_diff

__all__ = ["SELF_CHECK_RTOL", "SelfCheckFailed", "SelfCheckResult", "compare_with_stock",
           "self_check_bound"]

SELF_CHECK_RTOL = {torch.float32: FP32_RTOL, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
QUANTITIES = ("log_probs", "entropy")


class SelfCheckFailed(RuntimeError):
    """The shared path's results differ from the stock path's beyond the dtype's bound: a bug in
    prefix sharing (or in a kernel it calls) on this setup. Not bad input: it keeps its
    traceback."""


def self_check_bound(dtype: torch.dtype) -> float:
    """The largest relative difference the self-check accepts in ``dtype`` (see the module doc)."""
    return SELF_CHECK_RTOL.get(dtype, FP32_RTOL)


@dataclasses.dataclass(frozen=True)
class SelfCheckResult:
    """Per quantity, the largest absolute and relative differences, and the bound they meet."""

    dtype: torch.dtype
    max_abs_diff: dict[str, float]
    max_rel_diff: dict[str, float]
    bound: float

    @property
    def passed(self) -> bool:
        return all(diff <= self.bound for diff in self.max_rel_diff.values())

    def describe(self) -> str:
        figures = "; ".join(f"{q}: max abs diff {self.max_abs_diff[q]:.3e}, max rel diff "
                            f"{self.max_rel_diff[q]:.3e}" for q in self.max_abs_diff)
        verdict = "within" if self.passed else "BEYOND"
        return (f"prefix-sharing self-check (shared vs stock path, {self.dtype}): {figures}; "
                f"{verdict} the bound {self.bound:.1e} relative")

    def as_metrics(self) -> dict[str, float]:
        """The figures over both quantities (their maxima) under ``prefix_sharing/``."""
        return {"prefix_sharing/self_check_max_abs_diff": max(self.max_abs_diff.values()),
                "prefix_sharing/self_check_max_rel_diff": max(self.max_rel_diff.values()),
                "prefix_sharing/self_check_bound": self.bound}

    def raise_if_beyond(self) -> None:
        if not self.passed:
            raise SelfCheckFailed(
                self.describe() + ". The shared path does not give the stock results on this "
                "setup: please report it with the figures; set prefix_grouper.self_check: false "
                "only to train anyway, or use_prefix_grouper: false to train without sharing")


def compare_with_stock(shared: Mapping[str, Sequence[torch.Tensor]],
                       stock: Mapping[str, Sequence[torch.Tensor]],
                       dtype: torch.dtype,
                       read_from: Sequence[int] | None = None) -> SelfCheckResult:
    """Compares one micro-batch's per-sample outputs (``log_probs``, and ``entropy`` where the
    stock side has it), sample by sample, from each sample's ``read_from`` position on (the
    shared path scores only what verl reads, :func:`prefix_sharing.head_logprobs.read_positions`;
    ``None``: every position).

    Each sample's last log-prob predicts nothing (verl fills it from a wrapped-around label,
    the shared path gives 0; nothing downstream reads it) and is left out. Raises
    (AssertionError) when the two sides hold different samples or shapes: a check that
    compared nothing must not pass.
    """
    if "log_probs" not in stock:
        raise AssertionError("self-check: the stock path returned no log_probs")
    abs_diff, rel_diff = {}, {}
    for quantity in (q for q in QUANTITIES if q in stock):
        upto = -1 if quantity == "log_probs" else None
        pairs = list(zip(_samples(shared[quantity]), _samples(stock[quantity]), strict=True))
        if not pairs:
            raise AssertionError("self-check: an empty micro-batch")
        starts = [0] * len(pairs) if read_from is None else read_from
        candidate = torch.cat([a[s:upto].reshape(-1) for (a, _), s in zip(pairs, starts)])
        reference = torch.cat([b[s:upto].reshape(-1) for (_, b), s in zip(pairs, starts)])
        candidate, reference = candidate.double(), reference.double()
        abs_diff[quantity] = max_abs_diff(candidate, reference.to(candidate.device))
        rel_diff[quantity] = max_rel_diff(candidate, reference.to(candidate.device))
    return SelfCheckResult(dtype, abs_diff, rel_diff, self_check_bound(dtype))


def _samples(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per sample, from a jagged nested tensor (verl's layout), a padded one or a
    list."""
    return list(value.unbind()) if isinstance(value, torch.Tensor) else list(value)
