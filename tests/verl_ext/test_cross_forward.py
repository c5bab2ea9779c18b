"""Groups larger than ``max_token_len_per_gpu`` inside verl's real Megatron engine (whichever
supported verl is installed): with ``prefix_grouper.cross_micro_batch`` each such group's prefix
is computed once and its tails run as consecutive micro-batches; ``infer_batch`` (log-probs,
entropy) and ``forward_backward_batch`` (verl's ``ppo_loss``, every gradient) equal verl's
stock step with the feature off on the same weights, and the tokens computed are each group's
unique tokens.

Batch: 2 agent tasks of 3 episodes (59-65 tokens; 34- and 36-token common prefixes, a branch
at every turn). At a budget of 80 both groups cross micro-batches (3 each); at 70 the second
one's prefix is over half the budget, so it nests (``test_cross_nested.py``) beside the first
one's one level. At ``context_parallel_size=2`` (two gloo ranks)
every micro-batch is split over the CP ranks and the step equals the stock one at CP=1; at
CP=2 x TP=2 with sequence parallelism (four ranks), the stock one at TP=2.
"""

import contextlib
import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._batch import PRESET, make_batch, plain_output, use_cpu_platform  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._engine import actor_config, build_engine  # noqa: E402

CROSS = {"mode": "arbitrary_prefix", "min_prefix_len": 1, "cross_micro_batch": True}
AGENT = dict(num_tasks=2, num_turns=2, branching=3)
BUDGETS = (80, 70)


def batch(budget: int):
    from verl.utils import tensordict_utils as tu

    data = make_batch("agent", **AGENT)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
    return data


def steps(rank: int) -> dict:
    """verl's stock step (feature off), the cross-micro-batch one per budget, and a control,
    each on a fresh copy of the same seeded model."""
    from verl.workers.utils.losses import ppo_loss

    from tests.megatron_ext._controls import blocks_take_no_gradients

    use_cpu_platform()
    results = {}
    # verl's stock step does not depend on how it splits the batch: one serves both budgets
    runs = [(80, "off", None)] + [(budget, "cross", CROSS) for budget in BUDGETS]
    for budget, name, prefix_grouper in runs + [(80, "control", CROSS)]:
        config = actor_config(prefix_grouper)
        engine = build_engine(config)
        infer = engine.infer_batch(batch(budget))
        # the control: the prefix's backward step drops what its readers accumulated
        with blocks_take_no_gradients() if name == "control" else contextlib.nullcontext():
            train = engine.forward_backward_batch(batch(budget), partial(ppo_loss, config=config))
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[budget, name] = {"infer": plain_output(infer), "train": plain_output(train),
                                 "grads": grads}
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(steps, 1, timeout=300)[0]


@pytest.mark.parametrize("budget", BUDGETS)
def test_log_probs_entropy_loss_and_every_gradient_equal_verls_stock_step(results, budget):
    # back in batch order (restore_dynamic_batch); the loss is verl's global token mean, summed
    # over micro-batches (the two runs split the batch differently)
    same_outputs(results[budget, "cross"], results[80, "off"], f"budget {budget}",
                 per_micro_batch=False)


def test_a_control_that_drops_the_earlier_micro_batches_prefix_gradients_fails(results):
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(results[80, "control"], results[80, "off"], "control", per_micro_batch=False)


def context_parallel_steps(rank: int) -> dict:
    """At ``context_parallel_size=2``: the cross-micro-batch step at a budget of 80 (every
    micro-batch, the prefix's included, split over the CP ranks), the same under megatron's
    full activation recompute, and the control, the gradients averaged over the CP group as
    megatron's DDP does."""
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import finalize_context_parallel_grads
    from tests.megatron_ext._controls import blocks_take_no_gradients

    use_cpu_platform()
    results = {}
    for name in ("cross", "recompute", "control"):
        config = actor_config(CROSS, megatron={"context_parallel_size": 2})
        engine = build_engine(config, **(RECOMPUTE["full"] if name == "recompute" else {}))
        # verl's budget is max_token_len_per_gpu x CP: 40 per GPU is the 80 of the CP=1 run
        infer = engine.infer_batch(batch(40))
        rows = []  # each forward's rows on this rank (the prefix pass calls it positionally)
        engine.module[0].register_forward_pre_hook(
            lambda module, args, kwargs, rows=rows: rows.append(
                kwargs.get("input_ids", args[0] if args else None).size(1)), with_kwargs=True)
        with blocks_take_no_gradients() if name == "control" else contextlib.nullcontext():
            train = engine.forward_backward_batch(batch(40), partial(ppo_loss, config=config))
        finalize_context_parallel_grads(engine.module[0])
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[name] = {"infer": plain_output(infer), "train": plain_output(train),
                         "grads": grads, "rows": rows}
    return results


@pytest.fixture(scope="module")
def context_parallel_results():
    return run_distributed(context_parallel_steps, 2, cp=2, timeout=900)


def test_context_parallel_2_equals_verls_stock_step_at_cp1(context_parallel_results, results):
    """Both CP ranks return every sample whole and, with the gradients averaged over CP, equal
    the stock step at CP=1, with and without megatron's activation recompute (the prefix's
    recomputed layers replayed on their CP slice); each rank ran half of every micro-batch's
    rows (the prefix's included), and the control fails."""
    for rank, result in enumerate(context_parallel_results):
        for name in ("cross", "recompute"):
            cross = result[name]
            metrics = cross["train"]["metrics"]
            assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
            assert metrics["prefix_sharing/groups_split"] == [0.0]
            same_outputs(cross, results[80, "off"], f"cp2 {name} rank {rank}",
                         per_micro_batch=False)
            # 2 groups x (the prefix + 3 micro-batches), each forward half its computed rows
            assert len(cross["rows"]) == 8 and 2 * sum(cross["rows"]) >= sum(
                metrics["prefix_sharing/tokens_computed"])
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(result["control"], results[80, "off"], "control",
                         per_micro_batch=False)


def test_each_group_computes_its_unique_tokens_once_and_verls_metrics_say_so(results):
    from prefix_sharing import PrefixSharingConfig, build_plan
    from prefix_sharing.workloads import make_workload

    wl = make_workload("agent", vocab_size=512, seed=0, **AGENT)
    config = PrefixSharingConfig(min_prefix_len=1)
    unique = [build_plan([wl.sequences[m] for m in g.members], config).num_tokens_unique
              for g in wl.groups]
    assert unique == [119, 114]
    metrics = results[80, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"] == [float(sum(unique))]
    assert metrics["prefix_sharing/tokens_total"] == [float(sum(map(len, wl.sequences)))]
    assert metrics["prefix_sharing/num_micro_batches"] == [6.0]  # 3 per group, none cut
    assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    assert metrics["prefix_sharing/max_tokens_computed"][0] <= 80
    # the larger prefix's K/V leaves and their gradients, held across its micro-batches:
    # 2 (K, V) x 2 x layers x 36 tokens x K/V heads x head dim x 4 bytes
    assert metrics["prefix_sharing/prefix_kv_held_bytes"] == [
        float(2 * 2 * PRESET.num_layers * 36 * PRESET.num_query_groups * PRESET.head_dim * 4)]
    # the library's names: the same held bytes; nothing computed twice (every branch whole)
    assert metrics["prefix_sharing/cross_held_bytes"] == metrics[
        "prefix_sharing/prefix_kv_held_bytes"]
    assert metrics["prefix_sharing/cross_recomputed_tokens"] == [0.0]


RECOMPUTE = {  # megatron's activation recompute, on the model of both runs
    "full": dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),  # core attention
}
# a 7-key sliding window on every other layer: shorter than the 34-36-token prefixes, so the
# suffixes' gathers of the prefix rows are trimmed
SETTINGS = {**RECOMPUTE, "window": dict(window_size=(6, 0), window_attn_skip_freq=2)}


def setting_steps(rank: int) -> dict:
    """Per setting: verl's stock step and the cross-micro-batch one at a budget of 80 with the
    same setting; on ``full`` recompute, a control whose recomputed layers take the mode the
    store is in when the backward replays them (the last micro-batch's), not their own."""
    from unittest import mock

    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.prefix_kv import PrefixKVPass

    use_cpu_platform()
    wrong_mode = property(lambda self: self.store.mode, lambda self, mode: None)
    results = {}
    for (setting, settings), name in [(item, name) for item in SETTINGS.items()
                                      for name in ("off", "cross")] + [
                                          (("full", RECOMPUTE["full"]), "control")]:
        config = actor_config(None if name == "off" else CROSS)
        engine = build_engine(config, **settings)
        infer = engine.infer_batch(batch(80))
        patch = (mock.patch.object(PrefixKVPass, "mode", wrong_mode, create=True)
                 if name == "control" else contextlib.nullcontext())
        with patch:
            train = engine.forward_backward_batch(batch(80), partial(ppo_loss, config=config))
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[setting, name] = {"infer": plain_output(infer), "train": plain_output(train),
                                  "grads": grads}
    return results


@pytest.fixture(scope="module")
def setting_results():
    return run_distributed(setting_steps, 1, timeout=600)[0]


@pytest.mark.parametrize("setting", SETTINGS)
def test_recompute_and_windows_equal_verls_stock_step_with_the_same_setting(
        setting_results, setting):
    """A recomputed layer replays the mode of its first run: the prefix's layers, replayed
    inside its backward step, carry every micro-batch's dK/dV in. A windowed
    layer's suffix gathers only the prefix rows its window sees."""
    cross = setting_results[setting, "cross"]
    assert cross["train"]["metrics"]["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
    same_outputs(cross, setting_results[setting, "off"], f"{setting}", per_micro_batch=False)


def test_a_control_that_replays_the_last_micro_batchs_mode_fails(setting_results):
    control = setting_results["full", "control"]
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(control, setting_results["full", "off"], "control",
                     per_micro_batch=False)


LONG_CONTEXT = {  # TP=2 (two gloo ranks) with sequence parallelism, without and with recompute
    "sp": dict(sequence_parallel=True),
    "sp_recompute": dict(sequence_parallel=True, **RECOMPUTE["full"]),
}


def sequence_parallel_steps(rank: int) -> dict:
    """Per setting: verl's stock step and the cross-micro-batch one at a budget of 80, each
    rank's gradients completed over the tensor-parallel group as megatron's finalize does
    (sequence parallelism leaves each rank the norm weights' share of its own rows)."""
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads

    use_cpu_platform()
    results = {}
    for setting, settings in LONG_CONTEXT.items():
        for name in ("off", "cross"):
            config = actor_config(None if name == "off" else CROSS,
                                  megatron=dict(tensor_model_parallel_size=2,
                                                sequence_parallel=True))
            engine = build_engine(config, **settings)
            infer = engine.infer_batch(batch(80))
            train = engine.forward_backward_batch(batch(80), partial(ppo_loss, config=config))
            finalize_sequence_parallel_grads(engine.module[0])
            grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
            results[setting, name] = {"infer": plain_output(infer), "train": plain_output(train),
                                      "grads": grads}
    return results


@pytest.fixture(scope="module")
def sequence_parallel_results():
    return run_distributed(sequence_parallel_steps, 2, tp=2, timeout=900)


@pytest.mark.parametrize("setting", LONG_CONTEXT)
def test_tensor_and_sequence_parallel_equal_verls_stock_step(sequence_parallel_results,
                                                             setting):
    """Each cross micro-batch's rows (the prefix's too) padded to TP and split over the ranks;
    every rank's outputs and gradients equal the stock step's."""
    for rank in sequence_parallel_results:
        cross = rank[setting, "cross"]
        metrics = cross["train"]["metrics"]
        assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
        assert metrics["prefix_sharing/groups_split"] == [0.0]
        same_outputs(cross, rank[setting, "off"], f"tp2 {setting}", per_micro_batch=False)


def context_tensor_parallel_steps(rank: int) -> dict:
    """At ``context_parallel_size=2`` x ``tensor_model_parallel_size=2`` with sequence
    parallelism (four gloo ranks): the cross-micro-batch step at a budget of 80 over CP (40 per
    GPU), the control, and sharing within micro-batches (``shared``: a budget of 160 over CP,
    each group in one micro-batch), each rank's gradients completed as megatron's finalize
    does (summed over TP for the sequence-parallel parameters, averaged over CP)."""
    from megatron.core import parallel_state
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import (finalize_context_parallel_grads,
                                                 finalize_sequence_parallel_grads)
    from tests.megatron_ext._controls import blocks_take_no_gradients

    use_cpu_platform()
    results = {"tp_rank": parallel_state.get_tensor_model_parallel_rank()}
    for name, sharing, budget in (("cross", CROSS, 40), ("control", CROSS, 40),
                                  ("shared", {**CROSS, "cross_micro_batch": False}, 80)):
        config = actor_config(sharing, megatron=dict(context_parallel_size=2,
                                                     tensor_model_parallel_size=2,
                                                     sequence_parallel=True))
        engine = build_engine(config, sequence_parallel=True)
        infer = engine.infer_batch(batch(budget))
        with blocks_take_no_gradients() if name == "control" else contextlib.nullcontext():
            train = engine.forward_backward_batch(batch(budget),
                                                  partial(ppo_loss, config=config))
        finalize_sequence_parallel_grads(engine.module[0])
        finalize_context_parallel_grads(engine.module[0])
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[name] = {"infer": plain_output(infer), "train": plain_output(train),
                         "grads": grads}
    return results


@pytest.fixture(scope="module")
def context_tensor_parallel_results():
    return run_distributed(context_tensor_parallel_steps, 4, tp=2, cp=2, timeout=900)


def test_context_x_tensor_parallel_equals_verls_stock_step_at_tp2(
        context_tensor_parallel_results, sequence_parallel_results):
    """Every rank returns every sample whole and, its gradients completed, equals the stock
    step at TP=2 (CP=1) on its tensor-parallel shard of the weights, across micro-batches and
    within them; the control fails."""
    for rank, result in enumerate(context_tensor_parallel_results):
        stock = sequence_parallel_results[result["tp_rank"]]["sp", "off"]
        cross = result["cross"]
        metrics = cross["train"]["metrics"]
        assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
        assert metrics["prefix_sharing/groups_split"] == [0.0]
        same_outputs(cross, stock, f"cp2 x tp2 rank {rank}", per_micro_batch=False)
        shared = result["shared"]
        assert shared["train"]["metrics"]["prefix_sharing/num_micro_batches"] == [2.0]
        same_outputs(shared, stock, f"cp2 x tp2 shared, rank {rank}", per_micro_batch=False)
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(result["control"], stock, "control", per_micro_batch=False)


def test_a_nested_group_runs_beside_a_one_level_group(results):
    """At 70 the second group's 36-token prefix is over half the budget: it nests (its blocks
    computed again in their backward steps) beside the first group's one level."""
    metrics = results[70, "cross"]["train"]["metrics"]
    assert metrics["prefix_sharing/groups_split"] == [0.0]
    assert metrics["prefix_sharing/cross_recomputed_tokens"][0] >= 36



def same_split(planned, splits: list | None = None):
    """``(recorded, replayed)``: verl's split ``planned`` that records its index lists (into
    ``splits`` when given), and a split that replays them in order (verl's stock step forced
    onto a cross run's split; ``splits`` may come from another launch)."""
    from verl.utils import tensordict_utils as tu

    splits = [] if splits is None else splits

    def recorded(*args, **kwargs):
        micro_batches, index_lists = planned(*args, **kwargs)
        splits.append(index_lists)
        return micro_batches, index_lists

    def replayed(batch, *args, **kwargs):
        index_lists = splits.pop(0)
        return [tu.index_select_tensor_dict(batch, idx) for idx in index_lists], index_lists

    return recorded, replayed


def moe_engine(config, **settings):
    """verl's Megatron engine on the tiny MoE preset with its router losses (aux, seq-aux,
    global-aux, z-loss), every router keeping its statistics across micro-batches."""
    from prefix_sharing.megatron_ext.moe import PrefixSharingRouter
    from prefix_sharing.presets import PRESETS, sharp

    preset = sharp(PRESETS["tiny-moe"])
    engine = build_engine(config, preset=preset,
                          spec=dict(num_experts=preset.num_experts, normalization="RMSNorm"),
                          **settings)
    routers = [m for m in engine.module[0].modules() if isinstance(m, PrefixSharingRouter)]
    assert routers and all(r.keeps_statistics() for r in routers)
    return engine


@contextlib.contextmanager
def statistics_over_computed_rows():
    """The control: each cross micro-batch's routers keep statistics over the rows it computes
    (a shared block counted once, where it runs), not over its plain micro-batch's."""
    from unittest import mock

    from megatron.core.transformer.moe.router import TopKRouter

    from prefix_sharing.megatron_ext.moe import PrefixSharingRouter

    def computed_rows(self, logits, padding_mask):
        return TopKRouter.routing(self, logits, padding_mask=padding_mask)

    with mock.patch.object(PrefixSharingRouter, "_routing_across_micro_batches", computed_rows):
        yield


def moe_steps(rank: int, settings: dict, megatron: dict | None = None,
              runs: tuple[str, ...] = ("cross", "off", "control"), splits: list | None = None,
              budget: int = 80) -> dict:
    """The tiny MoE preset with its router losses (aux, seq-aux, global-aux, z-loss): the
    cross-micro-batch step at ``budget``, then verl's stock step forced onto the split the
    cross step used (each of its micro-batches the same samples), since the router statistics
    are each micro-batch's own; then a control whose cross micro-batches keep statistics over
    the rows they compute (the prefix counted once, in the first). ``runs``: which of them;
    ``splits``: the cross step's split when it ran in another launch (returned as
    ``"splits"``)."""
    from unittest import mock

    import verl.workers.engine.utils as engine_utils
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import (finalize_context_parallel_grads,
                                                 finalize_sequence_parallel_grads)

    use_cpu_platform()
    planned = engine_utils.rearrange_micro_batches
    splits = [] if splits is None else splits
    recorded, replayed = same_split(planned, splits)

    results = {}
    for name in runs:
        split = {"cross": recorded, "off": replayed, "control": planned}[name]
        config = actor_config(None if name == "off" else CROSS, megatron=megatron)
        engine = moe_engine(config, **settings)
        wrong = (statistics_over_computed_rows() if name == "control"
                 else contextlib.nullcontext())
        with mock.patch.object(engine_utils, "rearrange_micro_batches", split), wrong:
            infer = engine.infer_batch(batch(budget))
            train = engine.forward_backward_batch(batch(budget),
                                                  partial(ppo_loss, config=config))
        finalize_sequence_parallel_grads(engine.module[0])
        finalize_context_parallel_grads(engine.module[0])
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[name] = {"infer": plain_output(infer), "train": plain_output(train),
                         "grads": grads}
    results["splits"] = list(splits)
    return results


MOE_LAYOUTS = {  # name: (tensor-parallel size, model settings); under sequence parallelism
    # (TP=2): test_cross_moe_sequence_parallel.py
    "tp1": (1, {}),
    "tp1_recompute": (1, RECOMPUTE["full"]),
}


@pytest.fixture(scope="module", params=list(MOE_LAYOUTS))
def moe_results(request):
    tp, settings = MOE_LAYOUTS[request.param]
    return request.param, run_distributed(moe_steps, tp, settings, tp=tp, timeout=900)


def test_moe_router_statistics_equal_verls_stock_step_on_the_same_split(moe_results):
    """Every rank's outputs, verl's loss per micro-batch and every gradient (the routers' carry
    the aux / z-loss terms of every sample's prefix copies); the control fails."""
    layout, ranks = moe_results
    for results in ranks:
        metrics = results["cross"]["train"]["metrics"]
        assert metrics["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
        same_outputs(results["cross"], results["off"], f"moe {layout}")
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results["control"], results["off"], f"moe {layout} control")


def test_moe_router_statistics_under_context_parallelism_equal_verls_stock_step_at_cp1():
    """At CP=2 (verl's budget is max_token_len_per_gpu x CP: 40 per GPU) each cross
    micro-batch's router statistics are split over the CP ranks as megatron's stock router
    splits its plain micro-batch, each plain token's z-loss weighing what it does at CP=1. The
    reference is verl's stock step at CP=1 forced onto the CP run's split, in a second launch
    (the test's plain engine runs the project's attention without a plan, which does not split
    over CP ranks): every rank's outputs, verl's loss per micro-batch and every gradient
    (averaged over CP, as megatron's DDP does); the control fails."""
    ranks = run_distributed(moe_steps, 2, {}, {"context_parallel_size": 2}, ("cross", "control"),
                            None, 40, cp=2, timeout=900)
    splits = ranks[0]["splits"]
    assert splits and all(rank["splits"] == splits for rank in ranks)
    (stock,) = run_distributed(moe_steps, 1, {}, None, ("off",), splits, timeout=900)
    for rank, results in enumerate(ranks):
        assert results["cross"]["train"]["metrics"][
            "prefix_sharing/prefix_recomputes_avoided"] == [4.0]
        same_outputs(results["cross"], stock["off"], f"moe cp2 rank {rank}")
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results["control"], stock["off"], f"moe cp2 rank {rank} control")
