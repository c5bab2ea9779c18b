"""verl's Megatron engine with ``apply_rope_fusion: true`` keeps the fused RoPE with
``prefix_grouper`` on: the sharing run equals verl's stock step under the same fusion and the
unfused stock step (old log-probs, entropy, ``ppo_loss``, every gradient), on GRPO and tree
batches. TE's fused kernels are CPU stand-ins of their documented semantics
(``tests/megatron_ext/fake_fused_rope.py``); the sharing run must call the BSHD one, the stock
run the THD one."""

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

import pytest  # noqa: E402

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402

WORKLOADS = ("grpo", "tree")


def _job(rank: int) -> dict:
    from tests.megatron_ext.fake_fused_rope import installed
    from tests.verl_ext._batch import make_batch, use_cpu_platform
    from tests.verl_ext._engine import actor_config, build_engine, step

    use_cpu_platform()
    found = {}
    for workload in WORKLOADS:
        for mode in ("off", "arbitrary_prefix"):
            config = actor_config(MODES[mode])
            found[workload, mode, "unfused"] = step(build_engine(config), config,
                                                    lambda: make_batch(workload))
            with installed() as calls:
                engine = build_engine(config, apply_rope_fusion=True)
                found[workload, mode, "fused"] = step(engine, config, lambda: make_batch(workload))
            found[workload, mode, "calls"] = set(calls)
    return found


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 1, timeout=400)[0]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_sharing_under_rope_fusion_matches_the_stock_step_fused_and_unfused(results, workload):
    shared = results[workload, "arbitrary_prefix", "fused"]
    for reference in ("fused", "unfused"):
        same_outputs(shared, results[workload, "off", reference], f"{workload} vs {reference}")
    assert results[workload, "arbitrary_prefix", "calls"] == {"sbhd"}
    assert results[workload, "off", "calls"] == {"thd"}
