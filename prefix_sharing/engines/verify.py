"""``verify``: the plain and the shared forward+backward of one micro-batch on the same weights.

The reference is megatron's stock local spec on padded input (no code of this package on its
path); the candidate is the prefix-sharing spec on the plan. With ``steps > 1`` the plain model
takes Adam steps and both are compared again at each new point: the shared model is given the
plain model's weights first, so each step checks one forward+backward rather than how two
optimizers drift apart (which Adam amplifies from any reordering of fp rounding; the 20-step
training test bounds that drift in fp32). In bf16 the plain run is also repeated in fp32 on
the same (rounded) weights, and the shared run passes when it is no further from that than 2x
(grads 3x) the plain bf16 run is (flash-attn's rule).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import PrefixSharingConfig
from ..planner import PromptGroup
from ..presets import ModelPreset
from ..equivalence import QUANTITIES, Comparison, within_tolerance

__all__ = ["VerifyRequest", "verify_job", "summarize"]


@dataclasses.dataclass(frozen=True)
class VerifyRequest:
    """Micro-batches (each: sequences and, for ``prompt_only``, prompt groups) to verify."""

    batches: list[tuple[list[torch.Tensor], list[PromptGroup] | None]]
    config: PrefixSharingConfig
    preset: ModelPreset
    dtype: torch.dtype = torch.float32
    steps: int = 1
    seed: int = 0
    lr: float = 1e-3


def verify_job(rank: int, request: VerifyRequest) -> list[list[dict]]:
    """Runs on every rank (see :mod:`prefix_sharing.engines.launch`); returns, per micro-batch
    and step, this rank's largest differences (outputs on the last stage, this stage's grads)."""
    from .megatron import gpt_model

    low_precision = request.dtype != torch.float32
    build = dict(dtype=request.dtype, seed=request.seed)
    models = {
        "shared": gpt_model(request.preset, layout="shared", **build),
        "plain": gpt_model(request.preset, layout="padded", **build),
        "reference": gpt_model(request.preset, layout="padded", seed=request.seed)
        if low_precision else None,
    }
    initial = [p.detach().clone() for p in models["plain"].parameters()]
    reports = []
    for sequences, groups in request.batches:
        _copy_weights(initial, models["plain"])
        reports.append(_verify_batch(models, [sequences], [groups], request))
    return reports


def _verify_batch(models: dict, batch: list, groups: list, request: VerifyRequest) -> list[dict]:
    from .megatron import compare, forward_backward

    optimizer = torch.optim.Adam(models["plain"].parameters(), lr=request.lr)
    steps = []
    for _ in range(request.steps):
        _copy_weights(models["plain"].parameters(), models["shared"])
        shared = forward_backward(models["shared"], batch, "shared", request.config, groups)
        plain = forward_backward(models["plain"], batch, "padded")
        if models["reference"] is None:
            shared_vs_ref, plain_vs_ref = compare(shared, plain), None
        else:  # fp32, on the same (rounded) weights
            _copy_weights(models["plain"].parameters(), models["reference"])
            ref = forward_backward(models["reference"], batch, "padded")
            shared_vs_ref, plain_vs_ref = compare(shared, ref), compare(plain, ref)
        steps.append({"shared": shared_vs_ref, "plain": plain_vs_ref, "digest": shared.digests[0]})
        optimizer.step()
    return steps


def summarize(ranks: list[list[list[dict]]], batch: int) -> dict:
    """One verdict for micro-batch ``batch`` over all ranks and steps: the largest
    differences, and whether they pass."""
    steps = [s for r in ranks for s in r[batch]]
    shared = _worst([s["shared"] for s in steps])
    plain_steps = [s["plain"] for s in steps if s["plain"] is not None]
    plain = _worst(plain_steps) if plain_steps else None
    verdict = within_tolerance(shared, plain)
    same_plan = len({s["digest"] for s in steps}) == 1
    return {
        "passed": all(verdict.values()) and same_plan,
        "within_tolerance": verdict,
        "same_plan_on_every_rank": same_plan,
        "max_abs_diff": shared.max_abs_diff,
        "max_rel_diff": shared.max_rel_diff,
        "plain_max_rel_diff": None if plain is None else plain.max_rel_diff,
    }


def _worst(comparisons: list[Comparison]) -> Comparison:
    return Comparison(
        {q: max(c.max_abs_diff[q] for c in comparisons) for q in QUANTITIES},
        {q: max(c.max_rel_diff[q] for c in comparisons) for q in QUANTITIES},
    )


def _copy_weights(source, target: torch.nn.Module) -> None:
    """``source``: parameters (an iterable of tensors) in ``target.parameters()`` order."""
    with torch.no_grad():
        for t, s in zip(target.parameters(), source, strict=True):
            t.copy_(s)
