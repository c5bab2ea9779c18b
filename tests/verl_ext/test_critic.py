"""verl's critic (its value-model engines) with ``critic.use_prefix_grouper`` on gives what it
gives with it off (whichever supported verl is installed: 0.9.1 or 0.8.0).

The critic config comes through verl's own conversion with the critic's sharing keys; the
engine is the one verl's registry selects for ``value_model``; see ``_critic``. Compared, fp32
within 1e-5: each sample's values (``infer_batch``), verl's ``value_loss`` summed over the
step's micro-batches and every gradient (``forward_backward_batch``), on GRPO and tree batches
(duplicates, strict prefixes): FSDP2 and FSDP1, one rank; Megatron at TP=1, one rank, and at
TP=2 with sequence parallelism, two gloo ranks (the value head scores each rank's slice of the
rows and gathers them, as verl's ``make_value_model`` head does). The control reads each value
one flat row too early and must fail the same comparison (FSDP2, Megatron TP=1 and TP=2).
Across micro-batches (verl 0.9.1's ``value_loss``; 0.8.0 keeps verl's split): the FSDP2 critic
and the Megatron critic at PP=1 and at PP=2 (each stage's gradients, the last stage's values
and loss), a control whose block backward steps drop their readers' gradients failing on the
gradients.
"""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES  # noqa: E402
from tests.verl_ext._critic import WORKLOADS, compare, refusals, run_fsdp, save_value_model  # noqa: E402,E501

SHARING = {"arbitrary_prefix": MODES["arbitrary_prefix"], "prompt_only": MODES["prompt_only"]}


def one_rank(rank: int, path: str) -> dict:
    """Every run of this file in one spawned rank (verl's import and start-up once)."""
    return {
        "fsdp2": run_fsdp(rank, path, {"off": None, **SHARING}),
        "fsdp1": run_fsdp(rank, path, {"off": None, "arbitrary_prefix": SHARING[
            "arbitrary_prefix"]}, strategy="fsdp"),
        "control": run_fsdp(rank, path, {"arbitrary_prefix": SHARING["arbitrary_prefix"]},
                            control=True),
        "refusals": refusals(rank, path),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = save_value_model(str(tmp_path_factory.mktemp("qwen2_critic")))
    return run_gloo(one_rank, 1, path, timeout=500)[0]


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("mode", list(SHARING))
def test_the_fsdp2_critic_gives_verls_values_loss_and_gradients(runs, workload, mode):
    shared, plain = runs["fsdp2"][workload, mode], runs["fsdp2"][workload, "off"]
    assert shared["engine"] == plain["engine"] == "PrefixSharingFSDPValueEngine"
    assert shared["train"]["metrics"]["prefix_sharing/token_ratio"][0] > 1.0  # it shared
    assert "prefix_sharing/token_ratio" not in plain["train"]["metrics"]
    assert compare(shared, plain) == []


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_fsdp1_critic_gives_verls_values_loss_and_gradients(runs, workload):
    run = runs["fsdp1"]
    assert compare(run[workload, "arbitrary_prefix"], run[workload, "off"]) == []


@pytest.mark.parametrize("workload", WORKLOADS)
def test_values_read_one_row_early_fail_the_comparison(runs, workload):
    """The control: the same comparison catches values shifted by one flat row."""
    found = compare(runs["control"][workload, "arbitrary_prefix"], runs["fsdp2"][workload, "off"])
    assert "loss" in found and any(f.startswith("values") for f in found)


def test_the_critic_refuses_a_sequence_split_and_the_self_check(runs):
    assert runs["refusals"] == {"ulysses": ["verl.critic.sequence_split"],
                                "self_check": ["verl.self_check.value_model"]}


@pytest.fixture(scope="module")
def megatron():
    """verl's Megatron value-model engine, TP=1, one rank (megatron on gloo)."""
    from prefix_sharing.engines.launch import run_distributed

    return run_distributed(megatron_rank, 1, SHARING, WORKLOADS, timeout=400)[0]


@pytest.fixture(scope="module")
def megatron_tp2():
    """The same at TP=2 with sequence parallelism: two gloo ranks, one process for all cases
    (the control on the GRPO batch only)."""
    from prefix_sharing.engines.launch import run_distributed

    return run_distributed(megatron_rank, 2, {"arbitrary_prefix": SHARING["arbitrary_prefix"]},
                           ("grpo",), tp=2, timeout=400)


def megatron_rank(rank: int, sharing: dict, control_workloads: tuple[str, ...]) -> dict:
    """The Megatron critic's runs (off and each ``sharing`` mode) and its control, in one
    spawned rank."""
    from tests.verl_ext._critic import run_megatron

    return {"runs": run_megatron(rank, {"off": None, **sharing}),
            "control": run_megatron(rank, {"arbitrary_prefix": SHARING["arbitrary_prefix"]},
                                    control=True, workloads=control_workloads)}


def assert_megatron_critic_exact(found: dict, workload: str, mode: str) -> None:
    shared, plain = found["runs"][workload, mode], found["runs"][workload, "off"]
    assert shared["engine"] == plain["engine"] == "PrefixSharingMegatronValueEngine"
    assert shared["train"]["metrics"]["prefix_sharing/token_ratio"][0] > 1.0
    assert compare(shared, plain) == []
    if (workload, "arbitrary_prefix") in found["control"]:
        control = compare(found["control"][workload, "arbitrary_prefix"], plain)
        assert "loss" in control and any(f.startswith("values") for f in control)  # it fails


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("mode", list(SHARING))
def test_the_megatron_critic_gives_verls_values_loss_and_gradients(megatron, workload, mode):
    assert_megatron_critic_exact(megatron, workload, mode)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_megatron_critic_at_tp2_with_sequence_parallelism_gives_verls_values_loss_and_gradients(
        megatron_tp2, workload):
    for found in megatron_tp2:
        assert_megatron_critic_exact(found, workload, "arbitrary_prefix")


def megatron_cross_rank(rank: int) -> dict:
    """The Megatron critic on the agent batch under an 80-token budget: sharing off, across
    micro-batches, and across micro-batches with a prefix whose backward step takes in none of
    its readers' gradients (the control)."""
    from tests.megatron_ext._controls import blocks_take_no_gradients
    from tests.verl_ext._critic import run_megatron
    from tests.verl_ext.test_cross_forward import CROSS

    runs = run_megatron(rank, {"off": None, "cross": CROSS}, workloads=("agent",), budget=80)
    with blocks_take_no_gradients():
        control = run_megatron(rank, {"cross": CROSS}, workloads=("agent",), budget=80)
    return {"runs": runs, "control": control}


def test_the_megatron_critic_across_micro_batches_gives_verls_values_loss_and_gradients():
    """Each group's prefix once across its micro-batches (its values kept as leaves, which its
    backward step takes the readers' gradients from, as the actor's log-probs): each sample's
    values, the step's value loss (summed over its micro-batches: the two runs split the batch
    differently) and every gradient equal verl's stock critic; the control fails on the
    gradients. verl 0.8.0's ``value_loss`` averages over each micro-batch, so there the engine
    keeps verl's split (no group crosses micro-batches) and the values, loss and gradients
    still equal verl's."""
    import inspect

    from verl.trainer.ppo.core_algos import compute_value_loss

    from prefix_sharing.engines.launch import run_distributed

    found = run_distributed(megatron_cross_rank, 1, timeout=400)[0]
    shared, plain = found["runs"]["agent", "cross"], found["runs"]["agent", "off"]
    assert compare(shared, plain) == []
    metrics = shared["train"]["metrics"]
    if "batch_num_tokens" not in inspect.signature(compute_value_loss).parameters:
        assert "prefix_sharing/prefix_recomputes_avoided" not in metrics
        return
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    assert metrics["prefix_sharing/num_micro_batches"] == [6.0]
    control = compare(found["control"]["agent", "cross"], plain)
    assert any(f.startswith("grad") for f in control), control


def fsdp_cross_rank(rank: int, path: str) -> dict:
    """The FSDP2 critic on the agent batch under an 80-token budget (one level) and a 70-token
    one (its second group nested): sharing off, across micro-batches, and the control."""
    from tests.megatron_ext._controls import blocks_take_no_gradients
    from tests.verl_ext._critic import run_fsdp
    from tests.verl_ext.test_cross_forward import CROSS

    found = {budget: run_fsdp(rank, path, {"off": None, "cross": CROSS}, workloads=("agent",),
                              budget=budget) for budget in (80, 70)}
    with blocks_take_no_gradients():
        found["control"] = run_fsdp(rank, path, {"cross": CROSS}, workloads=("agent",),
                                    budget=70)
    return found


def test_the_fsdp_critic_across_micro_batches_gives_verls_values_loss_and_gradients(
        tmp_path_factory):
    """verl's FSDP loop with each group's blocks around its micro-batches (every block's
    values kept as leaves and computed again in its backward step): each sample's values, the
    step's value loss (summed over its micro-batches) and every gradient equal verl's stock
    critic at both budgets; the control fails on the gradients. (verl 0.8.0 keeps verl's
    split, as for the Megatron critic.)"""
    import inspect

    from verl.trainer.ppo.core_algos import compute_value_loss

    path = save_value_model(str(tmp_path_factory.mktemp("qwen2_critic_cross")))
    found = run_gloo(fsdp_cross_rank, 1, path, timeout=500)[0]
    crossed = "batch_num_tokens" in inspect.signature(compute_value_loss).parameters
    for budget in (80, 70):
        shared, plain = found[budget]["agent", "cross"], found[budget]["agent", "off"]
        assert compare(shared, plain) == [], budget
        recomputed = shared["train"]["metrics"].get("prefix_sharing/cross_recomputed_tokens")
        assert (recomputed is not None and recomputed[0] > 0) == crossed, budget
    if crossed:
        control = compare(found["control"]["agent", "cross"], found[70]["agent", "off"])
        assert any(f.startswith("grad") for f in control), control


def megatron_cross_stage(rank: int) -> dict:
    """:func:`megatron_cross_rank` at PP=2: this rank's stage and its runs."""
    from megatron.core import parallel_state

    return {**megatron_cross_rank(rank),
            "last_stage": parallel_state.is_pipeline_last_stage()}


def test_the_megatron_critic_across_micro_batches_under_pipeline_parallelism():
    """PP=2 (two gloo ranks): each group's blocks run as micro-batches of megatron's 1F1B, the
    last stage reads every sample's prefix values out of them (kept as leaves); each stage's
    gradients, and on the last stage each sample's values and the step's value loss, equal
    verl's stock critic there; the control (blocks take in no gradients) fails on the
    gradients of every stage."""
    import inspect

    from verl.trainer.ppo.core_algos import compute_value_loss

    from prefix_sharing.engines.launch import run_distributed

    stages = run_distributed(megatron_cross_stage, 2, pp=2, timeout=600)
    assert [stage["last_stage"] for stage in stages] == [False, True]
    crossed = "batch_num_tokens" in inspect.signature(compute_value_loss).parameters
    for stage in stages:
        shared, plain = stage["runs"]["agent", "cross"], stage["runs"]["agent", "off"]
        assert compare(shared, plain, last_stage=stage["last_stage"]) == []
        if crossed:
            control = compare(stage["control"]["agent", "cross"], plain,
                              last_stage=stage["last_stage"])
            assert any(f.startswith("grad") for f in control), control
    if crossed:
        metrics = stages[-1]["runs"]["agent", "cross"]["train"]["metrics"]
        assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
