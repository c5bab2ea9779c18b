"""``verify``: the plain and the shared forward+backward of one micro-batch on the same weights.

The plain run is megatron's stock local spec on padded input (no code of this package on its
path); the shared run is the prefix-sharing spec on the plan. With ``steps > 1`` the plain model
takes Adam steps and both are compared again at each new point: the shared model is given the
plain model's weights first, so each step checks one forward+backward rather than how two
optimizers drift apart (which Adam amplifies from any reordering of fp rounding; the 20-step
training test bounds that drift in fp32).

The verdict is flash-attn's rule in every dtype: the plain run is repeated in higher precision
(float64 for a float32 run, float32 for bfloat16) on the same weights, and the shared run passes
when it is no further from that than 2x (grads 3x) the plain run in its own dtype is, plus a
floor (:func:`prefix_sharing.equivalence.within_tolerance`). A fixed "1e-5 of the plain fp32
run" fails correct code on large batches, where the plain run's own rounding grows; the shared
run's distance from the plain one is still reported (``vs_plain_max_rel_diff``).

With ``routes`` (one list of per-sequence ``[L_i, moe_layers, topk]`` routes per micro-batch)
every model is built with ``moe_enable_routing_replay=True`` and replays them: the shared run
through the plan (each computed row its tokens' route), the plain and the reference runs through
megatron's own ``RouterReplay`` on the padded batch.

With a ``token_budget`` the shared run is the cross-micro-batch one
(:mod:`~prefix_sharing.engines.cross_micro_batch`): each group (a prompt group of the batch, or
the whole batch) as its shared blocks and suffix micro-batches of at most that many
computed tokens; it is judged against the plain (and the reference) run of the same samples in
the same micro-batches: one plain micro-batch per suffix micro-batch, its samples whole. That is
the split a stock step would run them in, and what MoE router statistics (per micro-batch in
megatron) are defined over.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import PrefixSharingConfig
from ..planner import PromptGroup
from ..presets import ModelPreset
from ..equivalence import FP32_RTOL, QUANTITIES, Comparison, allowed_rel_diff, within_tolerance

__all__ = ["VerifyRequest", "verify_job", "plain_runs_job", "verify_cp_job", "summarize",
           "reference_dtype"]


@dataclasses.dataclass(frozen=True)
class VerifyRequest:
    """Micro-batches (each: sequences and, for ``prompt_only`` or a ``token_budget``, prompt
    groups) to verify; ``token_budget``: run the shared side across micro-batches of this many
    computed tokens; ``routes``: per micro-batch, the recorded MoE routes to replay;
    ``model_settings``: TransformerConfig fields of every model of the run (e.g. activation
    recompute)."""

    batches: list[tuple[list[torch.Tensor], list[PromptGroup] | None]]
    config: PrefixSharingConfig
    preset: ModelPreset
    dtype: torch.dtype = torch.float32
    steps: int = 1
    seed: int = 0
    lr: float = 1e-3
    token_budget: int | None = None
    routes: list[list[torch.Tensor]] | None = None
    model_settings: dict = dataclasses.field(default_factory=dict)


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the plain run is repeated in, to judge a run in ``dtype``."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def verify_job(rank: int, request: VerifyRequest) -> list[list[dict]]:
    """Runs on every rank (see :mod:`prefix_sharing.engines.launch`); returns, per micro-batch
    and step, this rank's largest differences (outputs on the last stage, this stage's grads)."""
    from .megatron import preset_model

    replay = _replay_settings(request)
    build = dict(dtype=request.dtype, seed=request.seed, **replay)
    models = {
        "shared": preset_model(request.preset, layout="shared", **build),
        "plain": preset_model(request.preset, layout="padded", **build),
        "reference": preset_model(request.preset, layout="padded", seed=request.seed,
                               dtype=reference_dtype(request.dtype), **replay),
    }
    initial = [p.detach().clone() for p in models["plain"].parameters()]
    reports = []
    for (sequences, groups), routes in zip(request.batches, _batch_routes(request)):
        _copy_weights(initial, models["plain"])
        reports.append(_verify_batch(models, [sequences], [groups], request, routes))
    return reports


def _replay_settings(request: VerifyRequest) -> dict:
    """The model settings of every model of the request: its own, and what its routes need."""
    replay = {} if request.routes is None else {"moe_enable_routing_replay": True}
    return {**request.model_settings, **replay}


def _batch_routes(request: VerifyRequest) -> list[list | None]:
    """Per micro-batch, the ``routes`` argument of its one-micro-batch forward_backward."""
    if request.routes is None:
        return [None] * len(request.batches)
    return [[r] for r in request.routes]


def plain_runs_job(rank: int, request: VerifyRequest) -> list[dict]:
    """The plain and the reference runs of every micro-batch at context-parallel size 1 (one
    step), for :func:`verify_cp_job`: megatron's stock attention cannot split a sequence."""
    from .megatron import forward_backward, preset_model

    replay = _replay_settings(request)
    plain = preset_model(request.preset, layout="padded", dtype=request.dtype, seed=request.seed,
                         **replay)
    reference = preset_model(request.preset, layout="padded", seed=request.seed,
                             dtype=reference_dtype(request.dtype), **replay)
    runs = []
    for (sequences, groups), routes in zip(request.batches, _batch_routes(request)):
        batch = [sequences]
        if request.token_budget is not None:  # the cross run's split (routes are refused)
            from .cross_micro_batch import plan_cross

            members = None if groups is None else [g.members for g in groups]
            split = plan_cross(sequences, request.token_budget, request.config, members)[2]
            batch = [[sequences[i] for i in m] for m in split]
        runs.append({"plain": forward_backward(plain, batch, "padded", routes=routes),
                     "reference": forward_backward(reference, batch, "padded", routes=routes)})
    return runs


def verify_cp_job(
    rank: int, request: VerifyRequest, plain_ranks: list[list[dict]]
) -> list[list[dict]]:
    """:func:`verify_job` under context parallelism: the shared run here, split over the CP
    ranks, against :func:`plain_runs_job`'s runs of the rank holding the same tensor- and
    pipeline-parallel position (same weights: seeded by parameter name)."""
    from megatron.core import parallel_state

    from .megatron import compare, preset_model

    plain_rank = (parallel_state.get_tensor_model_parallel_rank()
                  + parallel_state.get_tensor_model_parallel_world_size()
                  * parallel_state.get_pipeline_model_parallel_rank())
    model = preset_model(request.preset, layout="shared", dtype=request.dtype, seed=request.seed,
                         **_replay_settings(request))
    reports = []
    for (sequences, groups), runs, routes in zip(request.batches, plain_ranks[plain_rank],
                                                 _batch_routes(request)):
        shared, digest, cross = _shared_run(model, sequences, groups, request, routes)
        reports.append([{"shared": compare(shared, runs["reference"]),
                         "plain": compare(runs["plain"], runs["reference"]),
                         "vs_plain": compare(shared, runs["plain"]), "digest": digest,
                         "cross_micro_batch": None if cross is None else cross.report()}])
    return reports


def _shared_run(model, sequences: list, groups: list[PromptGroup] | None,
                request: VerifyRequest, routes: list | None = None) -> tuple:
    """The shared run of one micro-batch of the request (across micro-batches with a
    ``token_budget``): ``(run, digest of its plans, the cross run or None)``."""
    from .megatron import forward_backward

    if request.token_budget is None:
        shared = forward_backward(model, [sequences], "shared", request.config, [groups],
                                  routes=routes)
        return shared, shared.digests[0], None
    cross = _cross(model, sequences, groups, request, None if routes is None else routes[0])
    return cross.run, "".join(p.digest() for s in cross.schedules for p in s.plans()), cross


def _verify_batch(models: dict, batch: list, groups: list, request: VerifyRequest,
                  routes: list | None = None) -> list[dict]:
    from .megatron import compare, forward_backward

    optimizer = torch.optim.Adam(models["plain"].parameters(), lr=request.lr)
    steps = []
    for _ in range(request.steps):
        # the shared and the reference model compute with the plain model's (rounded) weights
        _copy_weights(models["plain"].parameters(), models["shared"])
        _copy_weights(models["plain"].parameters(), models["reference"])
        shared, digest, cross = _shared_run(models["shared"], batch[0], groups[0], request,
                                            routes)
        split, split_routes = batch, routes
        if cross is not None:
            split = [[batch[0][i] for i in members] for members in cross.plain_split]
            if routes is not None:  # the plain micro-batches replay their samples' routes
                split_routes = [[routes[0][i] for i in members] for members in cross.plain_split]
        plain = forward_backward(models["plain"], split, "padded", routes=split_routes)
        reference = forward_backward(models["reference"], split, "padded", routes=split_routes)
        steps.append({"shared": compare(shared, reference), "plain": compare(plain, reference),
                      "vs_plain": compare(shared, plain), "digest": digest,
                      "cross_micro_batch": None if cross is None else cross.report()})
        optimizer.step()
    return steps


def _cross(model, sequences: list, groups: list[PromptGroup] | None, request: VerifyRequest,
           routes: list | None = None):
    from .cross_micro_batch import forward_backward_cross

    members = None if groups is None else [g.members for g in groups]
    return forward_backward_cross(model, sequences, request.token_budget, request.config,
                                  groups=members, routes=routes)


def summarize(ranks: list[list[list[dict]]], batch: int, dtype: torch.dtype) -> dict:
    """One verdict for micro-batch ``batch`` over all ranks and steps: the largest
    differences, and whether they pass.

    Every step is judged on its own (each has its own plain rounding); the figures reported
    are the worst over steps and ranks.
    """
    steps = [s for r in ranks for s in r[batch]]
    verdicts = [within_tolerance(s["shared"], s["plain"], dtype) for s in steps]
    verdict = {q: all(v[q] for v in verdicts) for q in QUANTITIES}
    shared, plain, vs_plain = (_worst([s[key] for s in steps])
                               for key in ("shared", "plain", "vs_plain"))
    same_plan = len({s["digest"] for s in steps}) == 1
    cross = steps[0].get("cross_micro_batch")  # engines without it (hf) leave it out
    return {
        **({} if cross is None else cross),
        "passed": all(verdict.values()) and same_plan,
        "within_tolerance": verdict,
        "same_plan_on_every_rank": same_plan,
        "reference_dtype": str(reference_dtype(dtype)).removeprefix("torch."),
        "max_abs_diff": shared.max_abs_diff,
        "max_rel_diff": shared.max_rel_diff,
        "plain_max_rel_diff": plain.max_rel_diff,
        "allowed_rel_diff": allowed_rel_diff(plain, dtype),
        "vs_plain_max_abs_diff": vs_plain.max_abs_diff,
        "vs_plain_max_rel_diff": vs_plain.max_rel_diff,
        "vs_plain_within_fp32_rtol": all(d <= FP32_RTOL for d in vs_plain.max_rel_diff.values()),
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
