"""verl's ``router_replay`` with groups across micro-batches (``prefix_grouper.cross_micro_batch``)
in verl's real Megatron engine: each group cut on tokens and routes, every micro-batch replaying
its rows' routes, equal to verl's stock replay on the same split.

The tiny MoE preset with its aux loss and z-loss (each micro-batch's statistics are its own, so
the reference is verl's stock step forced onto the split the cross step used, as in
``test_cross_forward``'s MoE test) on the agent batch of ``test_cross_forward`` (2 tasks, 34-
and 36-token prefixes) at a budget of 80. ``R3``: the batch's routes (per token, as a
batch-invariant rollout records them), agreeing and with one route changed at token 18 of the
second group's 36-token prefix (that group's prefix then ends there): old log-probs, entropy
(``infer_batch``), verl's loss per micro-batch and every gradient (``forward_backward_batch``).
``R2``: the
recording ``infer_batch`` runs the ordinary split (its routers record per micro-batch), its
routes (equal to verl's own recording) replayed by the update across micro-batches. Control: the
group cut on its tokens alone fails.

The preset keeps its own weights: with ``sharp`` ones, the stored prefix read as a key source
(two calls of aten's CPU flash kernel merged by the log-sum-exp, where the stock step makes
one) rounds one expert's ``linear_fc2`` gradient 1.3e-5 apart, over the 1e-5 fp32 rule (R3,
agreeing and diverging routes; within it over the gather). Open in issue 39, as
``test_mcore_mla``'s no-norm variant.
"""

from __future__ import annotations

import contextlib
from functools import partial
from unittest import mock

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext.test_routing_replay import MOE  # noqa: E402

BUDGET = 80
CASES = (("R3", "agree"), ("R3", "diverge"), ("R2", None), ("R3", "tokens_only"))


def _routes(batch, preset):
    """The batch's routes as recorded, and with one route changed inside the longest shared
    prefix (the second group's), and where."""
    from prefix_sharing import PrefixSharingConfig
    from prefix_sharing.routes import diverge_inside_shared_prefix, recorded_routes

    sequences = list(batch()["input_ids"].unbind())
    agree = recorded_routes(sequences, preset.num_layers, preset.moe_router_topk,
                            preset.num_experts)
    diverged, where = diverge_inside_shared_prefix(sequences, agree, preset.num_experts,
                                                   PrefixSharingConfig(min_prefix_len=1))
    return {"agree": agree, "diverge": diverged, "tokens_only": diverged}, where


def _with_routes(batch, routes):
    import torch
    from verl.utils import tensordict_utils as tu

    data = batch()
    if routes is not None:
        data["routed_experts"] = torch.nested.as_nested_tensor(routes, layout=torch.jagged)
    tu.assign_non_tensor(data, enable_routing_replay=True)
    return data


def steps(rank: int, cases=CASES, layout: dict | None = None, nested: str | None = None) -> dict:
    """Per case: the cross step (its splits recorded), then verl's stock step with the same
    replay mode forced onto those splits; ``layout``: the engine's parallel settings;
    ``nested``: instead of the agent batch under 80, a batch of ``test_cross_nested`` under
    its budget (its groups nest)."""
    from tests.verl_ext._batch import plain_output, use_cpu_platform

    use_cpu_platform()  # before verl's router replay module takes its device name
    from tests.verl_ext.test_cross_forward import CROSS, batch, same_split
    import verl.workers.engine.utils as engine_utils
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.presets import PRESETS
    from tests.verl_ext._engine import actor_config, build_engine
    from tests.verl_ext import test_cross_nested

    preset = PRESETS["tiny-moe"]  # its own weights (module doc)
    batch = (partial(batch, BUDGET) if nested is None
             else partial(test_cross_nested.batch, nested))
    routes, where = _routes(batch, preset)
    planned = engine_utils.rearrange_micro_batches
    results = {"diverged_at": where}
    for mode, routes_name in cases:
        recorded, replayed = same_split(planned)
        for name, split in (("cross", recorded), ("off", replayed)):
            config = actor_config(None if name == "off" else CROSS, megatron=dict(
                router_replay=dict(_target_="verl.workers.config.EngineRouterReplayConfig",
                                   mode=mode), **(layout or {})))
            engine = build_engine(config, preset=preset,
                                  spec=dict(num_experts=preset.num_experts,
                                            normalization="RMSNorm"), **MOE)
            cut_on_tokens = contextlib.ExitStack()
            if name == "cross" and routes_name == "tokens_only":
                for module in ("cross_micro_batch", "verl_ext.cross_groups"):
                    cut_on_tokens.enter_context(mock.patch(
                        f"prefix_sharing.{module}.token_identity", lambda seqs, routes: seqs))
            with mock.patch.object(engine_utils, "rearrange_micro_batches", split), cut_on_tokens:
                replay = routes.get(routes_name)
                infer = plain_output(engine.infer_batch(_with_routes(batch, replay)))
                if mode == "R2":
                    replay = [r.long() for r in infer["model_output"]["routed_experts"]]
                train = engine.forward_backward_batch(_with_routes(batch, replay),
                                                      partial(ppo_loss, config=config))
            grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
            results[mode, routes_name, name] = {"infer": infer, "train": plain_output(train),
                                                "grads": grads, "replayed": replay}
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(steps, 1, timeout=900)[0]


def test_replay_under_pipeline_parallelism_equals_verls_stock_replay_on_the_same_split():
    """At PP=2, R3 with agreeing and diverging routes: every stage's routers replay the routes
    of the rows they run (the prefix rows' in the group's first and last micro-batch, each
    micro-batch's tails' after them); equal to verl's stock replay on every stage, and cut on
    tokens alone fails. (R2's recording at PP=2 returns the routes on the last stage only, so
    this test's stock reference cannot replay them on the first.)"""
    cases = (("R3", "agree"), ("R3", "diverge"), ("R3", "tokens_only"))
    stages = run_distributed(steps, 2, cases, {"pipeline_model_parallel_size": 2}, pp=2,
                             timeout=900)
    for rank, results in enumerate(stages):
        for case in cases[:2]:
            same_outputs(results[case + ("cross",)], results[case + ("off",)],
                         f"pp2 stage {rank} {case}")
        with pytest.raises(AssertionError, match="relative error"):
            same_outputs(results["R3", "tokens_only", "cross"],
                         results["R3", "tokens_only", "off"], f"pp2 stage {rank} tokens only")
    metrics = stages[-1]["R3", "agree", "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    # both groups cross micro-batches, each prefix (34 and 36 rows) computed twice
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [34.0 + 36.0]


@pytest.mark.parametrize("mode, routes", CASES[:3])
def test_replay_across_micro_batches_equals_verls_stock_replay_on_the_same_split(
        results, mode, routes):
    cross, off = results[mode, routes, "cross"], results[mode, routes, "off"]
    metrics = cross["train"]["metrics"]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"][0] >= 2, metrics
    same_outputs(cross, off, f"{mode} {routes}")
    if mode == "R2":  # the recording: verl's own, per token
        for i, (s, p) in enumerate(zip(cross["replayed"], off["replayed"], strict=True)):
            assert s.equal(p), f"R2 recorded routes of sample {i} differ"


def test_a_diverging_route_ends_the_group_prefix_and_tokens_alone_fail(results):
    """The diverged group still crosses micro-batches, its prefix now ending at the diverged
    token (more tokens computed than with agreeing routes); cut on tokens alone, one sample
    replays another's route there."""
    agree = results["R3", "agree", "cross"]["train"]["metrics"]
    diverge = results["R3", "diverge", "cross"]["train"]["metrics"]
    assert diverge["prefix_sharing/groups_split"] == agree["prefix_sharing/groups_split"] == [0.0]
    assert (diverge["prefix_sharing/tokens_computed"][0]
            > agree["prefix_sharing/tokens_computed"][0])
    with pytest.raises(AssertionError, match="relative error"):
        same_outputs(results["R3", "tokens_only", "cross"], results["R3", "tokens_only", "off"],
                     "tokens only")


def test_replay_in_nested_groups_equals_verls_stock_replay_on_the_same_split():
    """R3 on ``test_cross_nested``'s ``chunks`` batch under its budget of 30 (each group's
    prefix in two chunks, a sub-tree block): every block replays its rows' routes, each
    micro-batch its tails'; with agreeing and diverging routes equal to verl's stock replay on
    the same split, and cut on tokens alone fails."""
    cases = (("R3", "agree"), ("R3", "diverge"), ("R3", "tokens_only"))
    (results,) = run_distributed(steps, 1, cases, None, "chunks", timeout=900)
    for case in cases[:2]:
        metrics = results[case + ("cross",)]["train"]["metrics"]
        assert metrics["prefix_sharing/groups_split"] == [0.0]
        assert metrics["prefix_sharing/cross_recomputed_tokens"][0] > 0  # nested: recomputed
        same_outputs(results[case + ("cross",)], results[case + ("off",)], f"nested {case}")
    with pytest.raises(AssertionError, match="relative error"):
        same_outputs(results["R3", "tokens_only", "cross"], results["R3", "tokens_only", "off"],
                     "nested tokens only")
