"""Groups across micro-batches in verl's real Megatron engine under pipeline parallelism
(``pipeline_model_parallel_size=2``, two gloo ranks, TP=1, the dense tiny model in fp32).

verl runs its micro-batches through megatron's 1F1B schedule; each cross group's prefix rows
ride in its first micro-batch (without grad, recording the K/V leaves on both stages) and in
its last (with grad, read through), so megatron's backward of the last one is the prefix's
backward on every stage (``prefix_sharing/verl_ext/cross_pipeline.py``). ``infer_batch``
(log-probs, entropy) and ``forward_backward_batch`` (verl's ``ppo_loss``) equal verl's stock
step with the feature off on the same weights at PP=2: every gradient on each stage, and the
last stage's outputs and loss (verl's global token mean, summed over micro-batches: the two
runs split the batch differently). A control whose last micro-batch does not read the
accumulated gradients through fails on the gradients.

Batch: as ``test_cross_forward.py`` (2 agent tasks of 3 episodes, 34- and 36-token common
prefixes). At a budget of 80 both groups cross micro-batches (3 each, the carrying ones within
the budget); at 70 the second group's prefix is over half the budget and, since groups do not
nest under pipeline parallelism, it takes the ordinary split.
"""

import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._batch import use_cpu_platform  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._engine import actor_config, build_engine, step  # noqa: E402
from tests.verl_ext.test_cross_forward import CROSS, batch  # noqa: E402

PIPELINE = {"pipeline_model_parallel_size": 2}


def pipeline_steps(rank: int) -> dict:
    """verl's stock step (feature off), the cross-micro-batch step at budgets 80 and 70, and
    the control, each on a fresh copy of the same seeded model; this rank's stage."""
    from unittest import mock

    from prefix_sharing.megatron_ext import prefix_kv

    use_cpu_platform()
    # the control's last micro-batch drops what the earlier ones accumulated
    dropped = mock.patch.object(prefix_kv, "read_through", lambda recorded, leaf: recorded)
    results = {}
    runs = [(80, "off", None), (80, "cross", CROSS), (70, "cross", CROSS),
            (80, "control", CROSS)]
    for budget, name, prefix_grouper in runs:
        config = actor_config(prefix_grouper, megatron=PIPELINE)
        engine = build_engine(config)
        rows = []  # each forward's rows on this stage (the model's input_ids width)
        engine.module[0].register_forward_pre_hook(
            lambda module, args, kwargs, rows=rows: rows.append(kwargs["input_ids"].size(1)),
            with_kwargs=True)
        results[budget, name] = step(engine, config, partial(batch, budget),
                                     during=dropped if name == "control" else None)
        results[budget, name]["rows"] = rows
    return results


@pytest.fixture(scope="module")
def stages():
    return run_distributed(pipeline_steps, 2, pp=2, timeout=900)


@pytest.mark.parametrize("budget", (80, 70))
def test_pipeline_parallel_2_equals_verls_stock_step_on_each_stage(stages, budget):
    for rank, results in enumerate(stages):
        cross = results[budget, "cross"]
        same_outputs(cross, results[80, "off"], f"pp2 stage {rank} budget {budget}",
                     per_micro_batch=False)
    metrics = stages[-1][budget, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/groups_split"] == [0.0 if budget == 80 else 1.0]
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0 if budget == 80 else 2.0]
    assert metrics["prefix_sharing/max_tokens_computed"][0] <= budget


def test_the_first_and_last_micro_batch_of_each_group_carry_the_prefix_on_every_stage(stages):
    """Both stages run 2 groups x 3 micro-batches, the first and the last of each as two
    forwards (the 34- or 36-row prefix, then own rows, within the budget together), the
    middle one as one: 10 forwards per step (infer_batch's, then forward_backward_batch's);
    the prefix computed twice per group, which the metrics report."""
    group_forwards = [34, 31, 26, 34, 28, 36, 26, 23, 36, 29]
    for results in stages:
        assert results[80, "cross"]["rows"] == group_forwards * 2
    metrics = stages[-1][80, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [70.0]
    # each group's unique tokens (119 and 114: test_cross_forward.py) and its prefix again
    assert metrics["prefix_sharing/tokens_computed"] == [float(119 + 114 + 34 + 36)]
    assert metrics["prefix_sharing/num_micro_batches"] == [6.0]


def test_a_control_whose_last_micro_batch_does_not_read_through_fails(stages):
    for rank, results in enumerate(stages):
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results[80, "control"], results[80, "off"], f"pp2 stage {rank} control",
                         per_micro_batch=False)


@pytest.mark.parametrize("setting, named", [
    (dict(recompute_granularity="full"), "recompute_granularity='full'"),
    (dict(num_moe_experts=4), "num_moe_experts=4"),
    (dict(window_size=(6, 0)), r"window_size=\(6, 0\)")])
def test_untested_model_settings_are_refused_by_name_under_pipeline_parallelism(setting, named):
    """The engine's layout at PP=2, TP=1 passes; a model setting not tested under pipeline
    parallelism is refused at its first cross micro-batch (at PP=1 each of them runs:
    test_cross_forward.py)."""
    from types import SimpleNamespace

    from prefix_sharing.verl_ext.cross_forward import check_cross_engine_setup, check_cross_model
    from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError

    check_cross_engine_setup(SimpleNamespace(pipeline_model_parallel_size=2,
                                             tensor_model_parallel_size=1))
    config = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                  context_parallel_size=1, recompute_granularity=None, num_moe_experts=None,
                  window_size=None)
    check_cross_model(SimpleNamespace(config=SimpleNamespace(**config)))
    with pytest.raises(PrefixSharingSetupError,
                       match=f"pipeline_model_parallel_size=2 with {named}"):
        check_cross_model(SimpleNamespace(config=SimpleNamespace(**{**config, **setting})))
    check_cross_model(SimpleNamespace(config=SimpleNamespace(
        **{**config, **setting, "pipeline_model_parallel_size": 1})))
