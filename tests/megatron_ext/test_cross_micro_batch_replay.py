"""Routing replay across micro-batches: each shared prefix once, every row its recorded route.

One GRPO group (a 41-token prompt, 6 responses) on the tiny MoE preset runs across
micro-batches with routes replayed (megatron's ``moe_enable_routing_replay``; routes from
:func:`prefix_sharing.routes.recorded_routes`, not the model's own top-k). The reference is
megatron's stock step replaying the same routes on the same split (one plain micro-batch per
suffix micro-batch, its samples whole): outputs, loss, every gradient and every logged router
statistic. Routes that agree (the schedule is the tokens' own), and routes with one token's
route changed inside the token-identical prompt: the group's common prefix must end there,
the rest of the prompt becoming a sub-tree of the members that agree. Router variants: the
preset's aux + seq-aux + global-aux losses and z-loss (with the prefix kept and recomputed),
sigmoid scores with the expert bias on a chunked prompt (a budget of 25), and no statistics;
under megatron's full activation recompute (each replayed layer replays its routes too).

Controls: a schedule cut on the tokens alone (the diverged member reads a block that replays
another member's route) fails; a cross run without routes differs from the stock replay (so
the routes were replayed).

Under pipeline parallelism (PP=2, two gloo ranks; the first and the last suffix micro-batch
carry the common prefix, so a budget of 84): routes that agree and routes that diverge, every
stage's gradients and router statistics and the last stage's outputs against the stock
replay on the same split; the same controls fail.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from prefix_sharing.equivalence import max_rel_diff, within_tolerance
from prefix_sharing.routes import diverge_inside_shared_prefix, recorded_routes
from prefix_sharing.workloads import make_workload

from ._distributed import run_distributed
from ._router_statistics import reset_router_statistics, router_statistics
from .test_cross_micro_batch import (_LOSSES, CONFIG, MOE, MOE_VARIANTS, _split_runs,
                                     assert_equals_the_split_statistics_included)

FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
# (router variant, routes diverge?, token budget, recompute_prefix, model settings)
CASES = {
    "agree": ("losses", False, 70, False, {}),
    "diverge": ("losses", True, 70, False, {}),
    "diverge_recomputed": ("losses", True, 70, True, {}),
    # megatron's full recompute replays each layer, its router's routes with it
    "diverge_full_recompute": ("losses", True, 70, False, FULL_RECOMPUTE),
    "expert_bias_chunked": ("expert_bias", True, 25, False, {}),
    "no_statistics": ("no_statistics", True, 70, False, {}),
}
CONTROLS = ("tokens_only", "native")  # on the "diverge" case
PIPELINED = {  # at PP=2
    "agree": ("losses", False, 84, False, {}),
    "diverge": ("losses", True, 84, False, {}),
}


def _group() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
    """The group, its routes as recorded, the same with one route diverging inside the prompt,
    and that token's position."""
    seqs = make_workload("grpo", num_prompts=1, group_size=6, prompt_len=(40, 41),
                         response_len=(12, 24), vocab_size=MOE.vocab_size, seed=5).sequences
    agree = recorded_routes(seqs, MOE.num_layers, MOE.moe_router_topk, MOE.num_experts, seed=7)
    diverged, (_, position) = diverge_inside_shared_prefix(seqs, agree, MOE.num_experts, CONFIG)
    return seqs, agree, diverged, position


def _job(rank: int, cases: dict = CASES) -> dict:
    from prefix_sharing.cross_micro_batch import common_prefix_len
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import compare, gpt_model

    seqs, agree, diverged, position = _group()
    report = {"diverged_at": position, "token_prefix_len": common_prefix_len(seqs)}
    runs = dict(cases)
    runs.update({name: cases["diverge"] for name in CONTROLS})
    for name, (variant, diverge, budget, recompute, settings) in runs.items():
        def build(layout: str, variant=variant, settings=settings,
                  **overrides) -> torch.nn.Module:
            return gpt_model(MOE, layout=layout, moe_enable_routing_replay=True,
                             **MOE_VARIANTS[variant], **settings, **overrides)

        routes = diverged if diverge else agree
        ours = build("shared")
        reset_router_statistics(ours)
        with _cut_on_tokens() if name == "tokens_only" else contextlib.nullcontext():
            cross = forward_backward_cross(ours, seqs, budget, CONFIG, recompute_prefix=recompute,
                                           routes=None if name == "native" else routes)
        stats = router_statistics(ours)
        (plain, plain_stats), (reference, _) = _split_runs(build, seqs, cross, routes)
        (schedule,) = cross.schedules
        report[name] = {
            "vs_reference": compare(cross.run, reference), "plain": compare(plain, reference),
            "vs_plain": compare(cross.run, plain), "figures": cross.report(),
            "statistics": {k: max_rel_diff(v, plain_stats[k]) for k, v in stats.items()},
            "statistic_names": sorted(plain_stats),
            "blocks": [(b.start, b.length, b.node) for b in schedule.blocks],
        }
    return report


def _cut_on_tokens():
    """Wrong: the group's tree cut on its tokens alone, as before routes were part of it (each
    block replays its first member's routes)."""
    return mock.patch("prefix_sharing.cross_micro_batch.token_identity",
                      lambda seqs, routes: seqs)


@pytest.fixture(scope="module")
def report() -> dict:
    return run_distributed(_job, 1, timeout=900)[0]


@pytest.fixture(scope="module")
def stages() -> list[dict]:
    return run_distributed(_job, 2, PIPELINED, pp=2, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_replay_across_micro_batches_equals_the_stock_replay_on_the_same_split(report, name):
    """Outputs, loss, every gradient (the float64 verdict and 1e-5 of the plain fp32 run) and
    every router statistic the stock step logs on the same micro-batches."""
    run = report[name]
    assert_equals_the_split_statistics_included(run)
    variant = CASES[name][0]
    expected = {"no_statistics": set(), "losses": _LOSSES,
                "expert_bias": _LOSSES | {"layer0.tokens_per_expert"}}[variant]
    assert expected <= set(run["statistic_names"]), run["statistic_names"]
    figures = run["figures"]
    recompute = sum(length for _, length, _ in run["blocks"]) if CASES[name][3] else 0
    assert figures["tokens_computed"] == figures["tokens_unique"] + recompute


def test_a_route_diverging_inside_the_prompt_ends_the_common_prefix_there(report):
    """Routes that agree: the prompt is the common prefix. One route changed at token ``p`` of
    the prompt: the common prefix is ``p`` tokens, the prompt's rest a sub-tree's block read
    by the members whose routes agree; every (token, route) prefix still computed once."""
    position, prompt = report["diverged_at"], report["token_prefix_len"]
    assert 0 < position < prompt
    assert report["agree"]["figures"]["prefix_lens"] == [prompt]
    for name in ("diverge", "diverge_full_recompute", "expert_bias_chunked", "no_statistics"):
        figures = report[name]["figures"]
        assert figures["prefix_lens"] == [position], (name, figures["prefix_lens"])
        nodes = {node for _, _, node in report[name]["blocks"]}
        assert len(nodes) >= 2, report[name]["blocks"]  # the prompt's rest is a node below
        assert figures["tokens_computed"] == figures["tokens_unique"]
    # the chunked case: the 20-token prefix and the rest of the prompt in chunks of <= 25
    assert all(length <= 25 for _, length, _ in report["expert_bias_chunked"]["blocks"])


def test_controls_fail(report):
    """Cutting the group on its tokens alone hands the diverged member another member's route
    at that token (outputs and gradients off); not replaying at all differs from the stock
    replay (the routes are not the model's own top-k)."""
    for name in CONTROLS:
        run = report[name]
        verdict = within_tolerance(run["vs_reference"], run["plain"], torch.float32)
        assert not verdict["log_probs"] and not verdict["grads"], (name, verdict)
    assert report["tokens_only"]["figures"]["prefix_lens"] == [report["token_prefix_len"]]


@pytest.mark.parametrize("name", list(PIPELINED))
def test_replay_under_pipeline_parallelism_equals_the_stock_replay(stages, name):
    """Each stage's gradients and router statistics, the last stage's outputs and loss; the
    prefix rows replay their routes in the first suffix (no grad) and the last (with grad)."""
    for stage in stages:
        assert_equals_the_split_statistics_included(stage[name])
    assert stages[-1][name]["figures"]["prefix_lens"] == (
        [stages[-1]["token_prefix_len"]] if name == "agree" else [stages[-1]["diverged_at"]])


def test_controls_fail_under_pipeline_parallelism(stages):
    for name in CONTROLS:
        verdict = within_tolerance(stages[-1][name]["vs_reference"], stages[-1][name]["plain"],
                                   torch.float32)
        assert not verdict["log_probs"] and not verdict["grads"], (name, verdict)
