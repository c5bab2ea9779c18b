"""verl's real trainer end to end on CPU: ``python -m verl.trainer.main_ppo``, GRPO, rollout.n = 4,
greedy (branch) rollouts, 3 steps, 2 data-parallel ranks, FSDP2 actor and reference with KL loss,
through ``prefix_sharing.testing.verl_cpu``; sharing on against ``ENABLE_PREFIX_SHARING=0`` with
the same config.

What can be equal. verl's actor loss is aggregated per micro-batch and normalised by the global
token count, and its metrics are means over micro-batches and ranks: a figure that depends on
which samples share a rank or a micro-batch changes when the partition changes, for reasons
that are not sharing. Sharing on may repartition (the sharing-aware balancer replaces verl's
``_balance_batch``), so the exact pairs run with ``trainer.balance_batch=false``: both runs then
put the same samples on the same ranks and micro-batches, and every figure - rollouts, pg_loss,
KL, entropy, grad_norm - must agree to fp32 tolerance. Rollouts are compared per prompt as sets
(the rollout's branch order follows request order, see ``rollout.py``).

Each run takes ~100 s on 2 cores (mostly Ray start-up); the off-run is shared (session scope).
``prompt_only`` fails until the i29-trainer branch is merged (the real trainer does not hand
the padded masks to the plugin today); it is written as it must pass.
"""

from __future__ import annotations

import math

import pytest

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1",))

from prefix_sharing.testing.verl_cpu.compare import (  # noqa: E402
    COMPARED, RATIO, relative_diff, rollouts_by_prompt)
from prefix_sharing.testing.verl_cpu.runner import run_main_ppo, tiny_grpo_overrides  # noqa: E402

STEPS = 3
FP32_RTOL = 1e-5
ABS_FLOOR = 1e-6  # pg_loss of on-policy GRPO is ~0 (advantages sum to zero per group)


def overrides(root, mode="arbitrary_prefix", extra=()):
    return [*tiny_grpo_overrides(root / "assets", n_ranks=2, steps=STEPS, mode=mode),
            "trainer.balance_batch=false", *extra]


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


def assert_same_steps(on, off):
    assert len(on.steps) == len(off.steps) == STEPS
    for step in range(STEPS):
        assert rollouts_by_prompt(on.generations[step]) == rollouts_by_prompt(off.generations[step])
        for name in COMPARED:
            a, b = on.steps[step][name], off.steps[step][name]
            assert math.isfinite(a) and abs(a - b) <= ABS_FLOOR + FP32_RTOL * max(abs(a), abs(b)), (
                f"step {step + 1} {name}: on {a!r} off {b!r} (rel {relative_diff(a, b):.2e})")
        assert on.steps[step][RATIO] > 1.0


def test_arbitrary_prefix_matches_stock_every_step(arbitrary_run, off_run):
    assert_same_steps(arbitrary_run, off_run)
    assert any(abs(s["actor/grad_norm"]) > 0 for s in off_run.steps)  # a step that trains


def test_prompt_only_matches_stock_every_step(workdir, off_run):
    run = run_main_ppo(workdir / "prompt_only", overrides(workdir, mode="prompt_only"),
                       enable_sharing=True)
    assert_same_steps(run, off_run)


def test_token_ratio_is_what_the_batch_gives(arbitrary_run):
    """Every sample's tokens counted once in total; computed tokens are at least each group's
    prompt once plus every response (the plan of a group kept together shares the prompt)."""
    for metrics in arbitrary_run.steps:
        total = metrics["actor/prefix_sharing/tokens_total"]
        computed = metrics["actor/prefix_sharing/tokens_computed"]
        assert metrics[RATIO] == pytest.approx(total / computed)
        assert computed < total


def test_checkpoint_saved_with_sharing_resumes_without(workdir, arbitrary_run, off_run):
    checkpoints = arbitrary_run.workdir / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").exists()
    resumed = run_main_ppo(
        workdir / "resumed",
        overrides(workdir, extra=[f"trainer.total_training_steps={STEPS + 1}",
                                  "trainer.resume_mode=resume_path",
                                  f"trainer.resume_from_path={checkpoints / f'global_step_{STEPS}'}"]),
        enable_sharing=False)
    assert [m["training/global_step"] for m in resumed.steps] == [STEPS + 1]
    assert math.isfinite(resumed.steps[0]["actor/pg_loss"])
