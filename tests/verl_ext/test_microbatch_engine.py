"""verl's batch settings inside its real Megatron engine (whichever supported verl is
installed), each giving the log-probs, entropy, loss and gradients of verl's own step with the
feature off:

- dynamic batch size: the group-keeping split runs in fewer micro-batches, with the split's
  figures in verl's metrics;
- fixed micro-batches (``use_dynamic_bsz: false``) over interleaved groups: the samples are
  put in an order whose micro-batches keep the groups whole, and the outputs come back in
  verl's order;
- the padded layout (``use_remove_padding: false``, verl's ``bshd`` forward): served, as the
  sharing forward plans from the micro-batch's nested ids either way. The reference is verl's
  packed step: its ``bshd`` step needs Transformer Engine's padding-mask attention (megatron's
  local-spec attention cannot take the ``(batch, seq)`` mask verl passes), which does not run
  on CPU; verl returns the same per-sample nested outputs from both.
"""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._batch import make_batch, use_cpu_platform  # noqa: E402
from tests.verl_ext._engine import actor_config, build_engine, step  # noqa: E402

SHARING = {"mode": "arbitrary_prefix", "min_prefix_len": 1}
BUDGET = 110  # the GRPO batch: 138 tokens, 107 computed with sharing
INTERLEAVED = [0, 3, 1, 4, 2, 5]  # the GRPO batch's two groups of 3, alternating


def batch_steps(rank: int) -> dict:
    """The same seeded model and GRPO batch under each setting, feature off and on."""
    from verl.utils import tensordict_utils as tu

    use_cpu_platform()

    def run(prefix_grouper, *, dynamic=False, fixed=False, remove_padding=True):
        config = actor_config(prefix_grouper)
        config.engine.use_remove_padding = remove_padding
        engine = build_engine(config)

        def data():
            batch = make_batch("grpo", micro_batch_size=3 if fixed else 2)
            if fixed:
                batch = tu.index_select_tensor_dict(batch, INTERLEAVED)
            if dynamic:
                tu.assign_non_tensor(batch, use_dynamic_bsz=True, max_token_len_per_gpu=BUDGET)
            tu.assign_non_tensor(batch, use_remove_padding=remove_padding)
            return batch

        return step(engine, config, data)

    results = {}
    for name, prefix_grouper in (("off", None), ("on", SHARING)):
        results["dynamic", name] = run(prefix_grouper, dynamic=True)
        results["fixed", name] = run(prefix_grouper, fixed=True)
        results["packed", name] = run(prefix_grouper)
    results["padded", "on"] = run(SHARING, remove_padding=False)
    try:  # the control: the setting reaches verl, whose bshd step fails here (module doc)
        run(None, remove_padding=False)
    except RuntimeError as error:
        results["padded", "off"] = str(error)
    return results


@pytest.fixture(scope="module")
def steps():
    return run_distributed(batch_steps, 1, timeout=300)[0]


def test_dynamic_bsz_results_equal_verls_own_split_with_the_feature_off(steps):
    # back in batch order (verl's restore_dynamic_batch); the loss is verl's global token mean
    same_outputs(steps["dynamic", "on"], steps["dynamic", "off"], "dynamic bsz",
                 per_micro_batch=False)


def test_dynamic_bsz_runs_fewer_micro_batches_with_the_split_in_verls_metrics(steps):
    assert len(steps["dynamic", "off"]["train"]["loss"]) == 2  # verl: 138 tokens, budget 110
    assert len(steps["dynamic", "on"]["train"]["loss"]) == 1  # 107 computed tokens fit in one
    metrics = steps["dynamic", "on"]["train"]["metrics"]
    assert metrics["prefix_sharing/num_micro_batches"] == [1.0]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    assert not any(k.startswith("prefix_sharing/")
                   for k in steps["dynamic", "off"]["train"]["metrics"])


def test_fixed_micro_batches_keep_interleaved_groups_whole_with_verls_results(steps):
    same_outputs(steps["fixed", "on"], steps["fixed", "off"], "fixed micro-batches")
    assert len(steps["fixed", "on"]["train"]["loss"]) == 2  # 3 samples each, as verl's
    # verl's chunks [a b a][b a b] cut both groups; GRPO's own order, in micro-batches of 2,
    # cuts both whatever the order (the control: the order is then kept)
    assert steps["fixed", "on"]["train"]["metrics"]["prefix_sharing/groups_split"] == [0.0]
    assert steps["packed", "on"]["train"]["metrics"]["prefix_sharing/groups_split"] == [2.0]


def test_the_padded_layout_is_served_with_verls_results(steps):
    same_outputs(steps["padded", "on"], steps["packed", "off"], "padded layout")
    same_outputs(steps["packed", "on"], steps["packed", "off"], "packed layout")
    metrics = steps["padded", "on"]["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]
    # verl's own padded step on the same engine reached the (batch, seq) mask it passes
    assert "must match the size of tensor" in steps.get(("padded", "off"), "(it ran)")
