"""verl's real trainer with its **Megatron** engine, end to end on CPU: ``python -m
verl.trainer.main_ppo model_engine=megatron``, GRPO, rollout.n = 4, 2 steps, 2 ranks, actor and
reference on verl's Megatron engine (KL loss), built through the vanilla mbridge; sharing on
against ``ENABLE_PREFIX_SHARING=0`` with the same config, on verl 0.9.1 and 0.8.0.

Two layouts of the 2 ranks: tensor-parallel (TP=2, one data-parallel rank; on verl 0.9.1) and
data-parallel (TP=1, DP=2, the trainer's balancing as in ``test_main_ppo.py``; on 0.8.0): each
pair of runs takes ~2.5 min, so each layout runs on one release. What the CPU shim stands in for
(``prefix_sharing.testing.verl_cpu.megatron``): Transformer Engine's layer spec becomes
megatron-core's local spec with a THD-capable core attention, so the model trained is
megatron-core's local GPT (sharing on replaces that core attention with its own, as it replaces
TE's), and verl's bf16/fp16-only dtype check lets fp32 through. verl 0.9.1's default route,
Megatron-Bridge, is not run: the release verl pins (0.5.2) is not on the package index, and the
newest there (0.3.1) pins transformers < 5, which verl 0.9.1 does not run with.

What compares: as ``test_main_ppo.py`` explains, verl's actor figures are global token means
(pg_loss, KL, entropy) and the global gradient norm, equal up to fp32 summation order however
the ranks and micro-batches hold the samples.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.verl_ext._requires import on_release, require_verl

require_verl(("0.9.1", "0.8.0"))

from prefix_sharing.testing.verl_cpu.compare import RATIO  # noqa: E402
from prefix_sharing.testing.verl_cpu.runner import run_main_ppo, tiny_grpo_overrides  # noqa: E402
from tests.verl_ext.trainer.test_main_ppo import assert_same_steps, group_plans  # noqa: E402

STEPS = 2
N_RANKS = 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("main_ppo_megatron")


@pytest.mark.parametrize("tensor_parallel", [
    pytest.param(2, id="tp2", marks=on_release("0.9.1", "0.8.0 runs the DP=2 layout")),
    pytest.param(1, id="dp2", marks=on_release("0.8.0", "0.9.1 runs the TP=2 layout")),
])
def test_megatron_engine_matches_stock_every_step(workdir, tensor_parallel):
    assert importlib.util.find_spec("mbridge"), "the vanilla-mbridge route needs mbridge (.[verl])"
    overrides = tiny_grpo_overrides(workdir / "assets", n_ranks=N_RANKS, steps=STEPS,
                                    strategy="megatron", tensor_parallel=tensor_parallel)
    name = f"tp{tensor_parallel}"
    on = run_main_ppo(workdir / f"{name}_on", overrides, enable_sharing=True)
    off = run_main_ppo(workdir / f"{name}_off", overrides, enable_sharing=False)
    assert_same_steps(on, off, steps=STEPS)  # rollouts, pg_loss, KL, entropy, grad_norm
    assert not any(RATIO in metrics for metrics in off.steps)
    assert any(abs(s["actor/grad_norm"]) > 0 for s in off.steps)  # a step that trains
    # the Megatron engines computed what the groups' plans give, padded to the TP size: every
    # data-parallel rank holds whole groups (verl averages the ranks' per-rank figures, TP peers
    # report the same)
    data_parallel = N_RANKS // tensor_parallel
    for metrics, (total, computed) in zip(on.steps, group_plans(on, tensor_parallel)):
        assert metrics["actor/prefix_sharing/tokens_total"] * data_parallel == pytest.approx(total)
        assert metrics["actor/prefix_sharing/tokens_computed"] * data_parallel == pytest.approx(
            computed)
        assert metrics[RATIO] == pytest.approx(total / computed, rel=1e-3) and total > computed
