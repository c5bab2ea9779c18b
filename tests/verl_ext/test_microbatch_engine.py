"""The group-keeping split inside verl's real Megatron engine (whichever supported verl is
installed): with dynamic batch size on, ``infer_batch`` and ``forward_backward_batch`` with
sharing give the same log-probs, entropy, loss and gradients as verl's own split with the
feature off - in fewer micro-batches, with the split's figures in verl's metrics."""

import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._batch import make_batch, plain_output, use_cpu_platform  # noqa: E402
from tests.verl_ext._engine import actor_config, build_engine  # noqa: E402

SHARING = {"mode": "arbitrary_prefix", "min_prefix_len": 1}
BUDGET = 110  # the GRPO batch: 138 tokens, 107 computed with sharing


def dynamic_bsz_steps(rank: int) -> dict:
    """The same seeded model and GRPO batch, feature off (verl's split) and on."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    use_cpu_platform()
    results = {}
    for name, prefix_grouper in (("off", None), ("on", SHARING)):
        config = actor_config(prefix_grouper)
        engine = build_engine(config)

        def batch():
            data = make_batch("grpo")
            tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
            return data

        infer = engine.infer_batch(batch())
        train = engine.forward_backward_batch(batch(), partial(ppo_loss, config=config))
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[name] = {"infer": plain_output(infer), "train": plain_output(train), "grads": grads}
    return results


@pytest.fixture(scope="module")
def steps():
    return run_distributed(dynamic_bsz_steps, 1, timeout=300)[0]


def test_results_equal_verls_own_split_with_the_feature_off(steps):
    # back in batch order (verl's restore_dynamic_batch); the loss is verl's global token mean
    same_outputs(steps["on"], steps["off"], "dynamic bsz", per_micro_batch=False)


def test_fewer_micro_batches_and_the_split_in_verls_metrics(steps):
    assert len(steps["off"]["train"]["loss"]) == 2  # verl: 138 tokens over a budget of 110
    assert len(steps["on"]["train"]["loss"]) == 1  # 107 computed tokens fit in one
    metrics = steps["on"]["train"]["metrics"]
    assert metrics["prefix_sharing/num_micro_batches"] == [1.0]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    assert not any(k.startswith("prefix_sharing/") for k in steps["off"]["train"]["metrics"])
