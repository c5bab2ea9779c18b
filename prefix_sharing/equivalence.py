"""Runs a model plain and with a sharing plan and measures how far apart the results are.

What is compared: logits (restored to every token), per-token log-probs, entropy, a
policy-gradient-style loss that uses both, and every parameter gradient. The plain side is
computed without the planner, the plan or this package's log-prob code, so it is an independent
reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

__all__ = [
    "RunOutputs",
    "Comparison",
    "compare_runs",
    "compare_pairs",
    "same_keys",
    "within_tolerance",
    "allowed_rel_diff",
    "FP32_RTOL",
    "plain_token_log_probs",
    "pg_loss",
    "advantages",
    "max_rel_diff",
    "max_abs_diff",
]

QUANTITIES = ("logits", "log_probs", "entropy", "loss", "grads")

# The shared run is judged by flash-attn's rule: it may be this many times as far from a
# higher-precision plain run (float64 for a float32 run, float32 for bfloat16) as the plain run
# in its own dtype is; gradients accumulate more rounding. A fixed bound cannot work: the plain
# run's own rounding grows with the batch (a prefix read by 18 sequences sums 18 gradient
# contributions in a different order), so "within 1e-5 of the plain fp32 run" fails correct
# code at scale. FP32_RTOL stays as a reported figure and as the fixed rule for small batches.
FP32_RTOL = 1e-5
LOW_PRECISION_FACTOR = {"grads": 3.0}
DEFAULT_LOW_PRECISION_FACTOR = 2.0
# ...plus a floor, relative to the quantity's scale, in units of the run dtype's machine
# epsilon. A tensor's largest difference is a maximum over many roundings, so a sliver (about
# 1e-5 in bf16, 1e-10 in fp32) covers a tensor the plain run happens to get (nearly) exact. A
# scalar's difference is a single sample of the rounding noise: the plain run may draw one near
# zero while a correct shared run draws a few ulps (of two such samples, one is twice the other
# a third of the time), so scalars get a few ulps. The loss is the one scalar; its inputs, the
# per-token log-probs and entropy, are judged token by token without that allowance.
SCALAR_QUANTITIES = ("loss",)
TENSOR_FLOOR_ULPS = 2.0**-10
SCALAR_FLOOR_ULPS = 4.0


@dataclasses.dataclass
class RunOutputs:
    """One forward+backward: packed ``(T_total, ...)`` outputs and gradients by parameter name."""

    logits: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]

    @classmethod
    def collect(
        cls,
        model: nn.Module,
        forward: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        weights: torch.Tensor,
    ) -> RunOutputs:
        """Runs ``forward() -> (logits, log_probs, entropy)``, the loss and its backward."""
        model.zero_grad(set_to_none=True)
        logits, log_probs, entropy = forward()
        loss = pg_loss(log_probs, entropy, weights)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return cls(logits.detach(), log_probs.detach(), entropy.detach(), loss.detach(), grads)

    def get(self, name: str) -> torch.Tensor | dict[str, torch.Tensor]:
        return getattr(self, name)


@dataclasses.dataclass
class Comparison:
    """Largest differences of a candidate run from a reference run, per quantity."""

    max_abs_diff: dict[str, float]
    max_rel_diff: dict[str, float]


def compare_runs(candidate: RunOutputs, reference: RunOutputs) -> Comparison:
    """Largest differences per quantity; raises (AssertionError) when the runs do not hold the
    same things: other parameter names, other shapes, or nothing at all to compare."""
    same_keys(candidate.grads, reference.grads, "gradients")
    pairs = {q: [(candidate.get(q), reference.get(q))] for q in QUANTITIES if q != "grads"}
    pairs["grads"] = [(candidate.grads[k], g) for k, g in reference.grads.items()]
    return compare_pairs(pairs)


def compare_pairs(pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> Comparison:
    """The largest differences over each quantity's ``(candidate, reference)`` tensor pairs.

    A quantity with no pairs reports 0, so a caller may pass an empty list where the runs hold
    no such output on this rank (an inner pipeline stage computes no loss) - but the whole
    comparison must hold some tensor, every pair must agree in shape (:func:`max_abs_diff`)
    and no tensor may be empty: a run that dropped its outputs never compares as equal.
    """
    if not any(pairs.values()):
        raise AssertionError("empty comparison: neither run holds any output or gradient")
    return Comparison(
        {q: max((max_abs_diff(a, b) for a, b in p), default=0.0) for q, p in pairs.items()},
        {q: max((max_rel_diff(a, b) for a, b in p), default=0.0) for q, p in pairs.items()},
    )


def same_keys(candidate: dict, reference: dict, what: str) -> None:
    """Raises (AssertionError) unless both dicts have the same keys, naming those in one only."""
    if candidate.keys() != reference.keys():
        only = sorted(map(str, candidate.keys() ^ reference.keys()))
        raise AssertionError(f"the runs have {what} for different names: {only}")


def within_tolerance(
    shared: Comparison,
    plain: Comparison | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, bool]:
    """Per quantity: is the shared run close enough to the plain one?

    Args:
        shared: the shared run against the reference: the plain run in ``dtype`` when
            ``plain`` is None, else the plain run in higher precision on the same weights.
        plain: the plain run in ``dtype`` against that same higher-precision reference;
            ``None`` for the fixed fp32 rule (within :data:`FP32_RTOL` relative).
        dtype: the dtype of the shared and plain runs (it sets the floor of
            :func:`allowed_rel_diff`); bfloat16 unless told.
    """
    if plain is None:
        return {q: d <= FP32_RTOL for q, d in shared.max_rel_diff.items()}
    allowed = allowed_rel_diff(plain, dtype)
    return {q: d <= allowed[q] for q, d in shared.max_rel_diff.items()}


def allowed_rel_diff(plain: Comparison, dtype: torch.dtype) -> dict[str, float]:
    """Per quantity, the largest relative difference from the higher-precision reference a
    shared run in ``dtype`` may have: a multiple of the plain run's, plus the floor."""
    eps = torch.finfo(dtype).eps
    return {
        q: LOW_PRECISION_FACTOR.get(q, DEFAULT_LOW_PRECISION_FACTOR) * d
        + eps * (SCALAR_FLOOR_ULPS if q in SCALAR_QUANTITIES else TENSOR_FLOOR_ULPS)
        for q, d in plain.max_rel_diff.items()
    }


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b|``; raises (AssertionError) on different shapes or empty tensors, which
    would otherwise compare as equal."""
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not a.numel():
        raise AssertionError(f"empty comparison: tensors of shape {tuple(a.shape)}")
    return (a.double() - b.double()).abs().max().item()


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``: relative to the reference's scale, robust to entries near 0."""
    diff = max_abs_diff(a, b)
    scale = b.double().abs().max().item()
    return diff / scale if scale > 0 else diff


def plain_token_log_probs(
    logits: torch.Tensor, sequences: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference log-probs and entropy from packed ``(T_total, vocab)`` logits, one sequence at a time."""
    log_probs, entropy = [], []
    for seq, lg in zip(sequences, torch.split(logits, [s.numel() for s in sequences])):
        logp = torch.log_softmax(at_least_fp32(lg), dim=-1)
        picked = logp[:-1].gather(1, seq[1:, None].to(logits.device)).squeeze(1)
        log_probs.append(torch.cat([picked, picked.new_zeros(1)]))
        entropy.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(log_probs), torch.cat(entropy)


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 when it is in a narrower float dtype; a float64 reference stays float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def advantages(num_tokens: int, seed: int) -> torch.Tensor:
    """Seeded per-token weights for :func:`pg_loss`, in ``[0.5, 1.5)``.

    Positive on purpose: with advantages of both signs the loss sums terms that cancel, and a
    near-zero loss makes its *relative* difference meaningless (a coin toss under bf16). Every
    gradient path is exercised whatever the signs.
    """
    return 0.5 + torch.rand(num_tokens, generator=torch.Generator().manual_seed(seed))


def pg_loss(log_probs: torch.Tensor, entropy: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A policy-gradient-shaped loss: per-token advantages times log-prob, minus an entropy bonus."""
    return -(weights * log_probs).sum() / weights.numel() - 0.01 * entropy.mean()
