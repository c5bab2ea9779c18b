"""verl's real trainer end to end on CPU: ``python -m verl.trainer.main_ppo``, GRPO, rollout.n = 4,
greedy (branch) rollouts, 3 steps, 2 data-parallel ranks, FSDP2 actor and reference with KL loss,
through ``prefix_sharing.testing.verl_cpu``; sharing on against ``ENABLE_PREFIX_SHARING=0`` with
the same config.

verl 0.9.1 (v1 trainer, TransferQueue) and 0.8.0 (its default trainer), both with
``trainer.balance_batch`` at its default (on): the sharing runs balance the ranks with the
sharing-aware partitioner (``verl_ext.balancing``), the stock run with verl's own. What can be
equal. verl normalises the actor loss over the global mini-batch (``batch_num_tokens`` x
``dp_size``, ``workers/utils/losses.py`` / ``agg_loss``) and sums the per-micro-batch metrics,
so pg_loss, KL, entropy and grad_norm are the global token means and the global gradient:
invariant to which rank or micro-batch holds a sample, up to fp32 summation order. So the
runs compare although their partitions differ; the token ratio is checked against the plans of
the sharing partition (each group whole on one rank: the ideal). All runs are
fp32 (verl's FSDP default computes in bf16: ``runner.py``); in bf16 grad_norm differs at bf16
rounding (the 2.4e-3 seen by hand), not because of sharing. on-policy GRPO's pg_loss is ~0 by
construction (the ratio is 1, advantages sum to 0 in a group), so it and the tiny KL are
compared absolutely (``TOLERANCES``); the policy gradient itself is checked through grad_norm.

Each run takes ~100 s on 2 cores (mostly Ray start-up); the off-run is shared (session scope).
"""

from __future__ import annotations

import math

import pytest

from tests.verl_ext._requires import on_release, require_verl

require_verl(("0.9.1", "0.8.0"))

from prefix_sharing.config import PrefixSharingConfig  # noqa: E402
from prefix_sharing.testing.verl_cpu.compare import (  # noqa: E402
    COMPARED, RATIO, relative_diff, rollouts_by_prompt)
from prefix_sharing.testing.verl_cpu.runner import run_main_ppo, tiny_grpo_overrides  # noqa: E402

STEPS = 3
N_RANKS = 2
# (relative, absolute) per figure. fp32 log-probs of ~5.8 nats round at ~5e-7 (one ulp):
# pg_loss (1e-8..3e-7: the ratio is 1 +- that rounding, advantages sum to 0; seen 1.8e-7 apart
# on 0.8.0 with grad_norm equal) and the KL (a square of log-prob differences, ~1e-5; seen
# 2e-9 apart) are compared absolutely at that rounding's effect on them.
TOLERANCES = {"actor/pg_loss": (0.0, 1e-6), "actor/kl_loss": (0.0, 1e-8),
              "actor/entropy": (1e-5, 0.0), "actor/grad_norm": (1e-5, 0.0)}


def overrides(root, mode="arbitrary_prefix", extra=()):
    return [*tiny_grpo_overrides(root / "assets", n_ranks=N_RANKS, steps=STEPS, mode=mode),
            *extra]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("main_ppo")


@pytest.fixture(scope="session")
def off_run(workdir):
    return run_main_ppo(workdir / "off", overrides(workdir), enable_sharing=False)


@pytest.fixture(scope="session")
def arbitrary_run(workdir):
    return run_main_ppo(workdir / "arbitrary", overrides(workdir, extra=["trainer.save_freq=1"]),
                        enable_sharing=True)


def assert_same_steps(on, off, steps=STEPS):
    assert len(on.steps) == len(off.steps) == steps
    for step in range(steps):
        assert rollouts_by_prompt(on.generations[step]) == rollouts_by_prompt(off.generations[step])
        for name in COMPARED:
            a, b = on.steps[step][name], off.steps[step][name]
            rtol, atol = TOLERANCES[name]
            assert math.isfinite(a) and abs(a - b) <= atol + rtol * max(abs(a), abs(b)), (
                f"step {step + 1} {name}: on {a!r} off {b!r} (rel {relative_diff(a, b):.2e})")
        assert on.steps[step][RATIO] > 1.0


def test_arbitrary_prefix_matches_stock_every_step(arbitrary_run, off_run):
    assert_same_steps(arbitrary_run, off_run)
    assert any(abs(s["actor/grad_norm"]) > 0 for s in off_run.steps)  # a step that trains


@on_release("0.8.0", "the arbitrary-prefix run is both releases'; prompt_only's planner is "
            "the same on both")
def test_prompt_only_matches_stock_every_step(workdir, off_run):
    run = run_main_ppo(workdir / "prompt_only", overrides(workdir, mode="prompt_only"),
                       enable_sharing=True)
    assert_same_steps(run, off_run)
    # a group's responses start with distinct tokens (rollout.py), so sharing the prompt alone
    # is all there is to share: the arbitrary-prefix planner gives prompt_only's figures
    assert_ratio_is_planned(run)


def group_plans(run, pad_to_multiple_of=1):
    """Per step, (tokens, computed tokens) of the step's batch with every GRPO group planned
    alone (build_plan on its members' token ids, from the rollout's token log): what the ranks
    compute when each group is whole on one rank and in one micro-batch (its flat rows padded
    to ``pad_to_multiple_of``, as the Megatron engine pads them to the TP size)."""
    from collections import defaultdict

    from prefix_sharing.planner import build_plan

    by_step = defaultdict(lambda: defaultdict(list))
    for record in run.token_log:
        by_step[record["global_steps"]][tuple(record["prompt"])].append(
            record["prompt"] + record["response"])
    plans = [[build_plan(members, PrefixSharingConfig(), pad_to_multiple_of=pad_to_multiple_of)
              for members in by_step[step].values()] for step in sorted(by_step)]
    return [(sum(p.num_tokens_total for p in step), sum(p.num_tokens_flat for p in step))
            for step in plans]


def assert_ratio_is_planned(run):
    """The ranks' engines computed what the groups' plans give, and the trainer's partition
    said so: its token ratio is the ideal one. verl averages the engines' per-rank figures."""
    planned = group_plans(run)
    assert len(planned) == STEPS
    for metrics, (total, computed) in zip(run.steps, planned):
        assert metrics["actor/prefix_sharing/tokens_total"] * N_RANKS == pytest.approx(total)
        assert metrics["actor/prefix_sharing/tokens_computed"] * N_RANKS == pytest.approx(computed)
        assert metrics["prefix_sharing/dp_token_ratio"] == pytest.approx(total / computed)
        assert metrics["prefix_sharing/dp_ideal_token_ratio"] == pytest.approx(total / computed)
        assert metrics["prefix_sharing/dp_groups_split"] == 0 and total / computed > 1.0


def test_token_ratio_is_what_the_ranks_plans_give(arbitrary_run):
    """The plugin's per-step token figures against build_plan on the step's groups, rebuilt
    from the rollout's token ids."""
    assert_ratio_is_planned(arbitrary_run)


@on_release("0.9.1", "verl's checkpoint manager holds no sharing state on either release")
def test_checkpoint_saved_with_sharing_resumes_without(workdir, arbitrary_run):
    checkpoints = arbitrary_run.workdir / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").exists()
    resume = [f"trainer.total_training_steps={STEPS + 1}", "trainer.resume_mode=resume_path",
              f"trainer.resume_from_path={checkpoints / f'global_step_{STEPS}'}"]
    resumed = run_main_ppo(workdir / "resumed", overrides(workdir, extra=resume),
                           enable_sharing=False)
    assert [m["training/global_step"] for m in resumed.steps] == [STEPS + 1]
    assert math.isfinite(resumed.steps[0]["actor/pg_loss"])


GAE_STEPS = 2
# the critic's figures beside the actor's; under GAE the advantages come from the critic's
# values, so pg_loss is no longer ~0 by construction: relative, with the same absolute floor
GAE_TOLERANCES = {**TOLERANCES, "actor/pg_loss": (1e-5, 1e-6),
                  "critic/vf_loss": (1e-5, 0.0), "critic/grad_norm": (1e-5, 0.0)}


@on_release("0.9.1", "on 0.8.0 the critic's engine step against verl's stock critic is "
            "tests/verl_ext/test_critic.py")
def test_ppo_with_gae_matches_stock_with_actor_reference_and_critic_sharing(workdir):
    """PPO with GAE (one on / off pair, 2 steps): the actor, the reference and the critic all
    share; every step's actor and critic figures equal the stock run's, and each role's engine
    reports that it shared."""
    gae = [*tiny_grpo_overrides(workdir / "assets", n_ranks=N_RANKS, steps=GAE_STEPS,
                                critic=True)]
    on = run_main_ppo(workdir / "gae_on", gae, enable_sharing=True)
    off = run_main_ppo(workdir / "gae_off", gae, enable_sharing=False)
    assert len(on.steps) == len(off.steps) == GAE_STEPS
    for step in range(GAE_STEPS):
        for name, (rtol, atol) in GAE_TOLERANCES.items():
            a, b = on.steps[step][name], off.steps[step][name]
            assert math.isfinite(a) and abs(a - b) <= atol + rtol * max(abs(a), abs(b)), (
                f"step {step + 1} {name}: on {a!r} off {b!r} (rel {relative_diff(a, b):.2e})")
        shared = {k: v for k, v in on.steps[step].items() if k.endswith("token_ratio")}
        assert shared[RATIO] > 1.0 and shared["critic/prefix_sharing/token_ratio"] > 1.0, shared
        assert not any(k.endswith("prefix_sharing/token_ratio") for k in off.steps[step])
    assert any(abs(s["critic/grad_norm"]) > 0 for s in off.steps)  # the critic trains
