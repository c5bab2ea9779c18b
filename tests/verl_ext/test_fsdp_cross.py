"""Groups larger than ``max_token_len_per_gpu`` inside verl's real FSDP engine: with
``prefix_grouper.cross_micro_batch`` each such group's prefix is computed once and its tails
run as consecutive micro-batches of verl's own loop; ``infer_batch`` (log-probs, entropy) and
``forward_backward_batch`` (verl's ``ppo_loss``, every gradient) equal verl's stock step with
the feature off on the same weights - FSDP2 and FSDP1, with verl's gradient checkpointing
(non-reentrant) on, and FSDP2 under Ulysses sequence parallelism of 2 (each rank runs half of
every micro-batch's rows, a block's included, and records its blocks' K/V for its half of the
heads), on two ranks (the parameters sharded over both; the same batch on each:
with cross groups a rank's micro-batch count follows its groups, and verl wants the same count
on every rank, which a trainer's balancing gives and two random batches do not).

Batch: 2 agent tasks of 3 episodes (59-65 tokens; 34- and 36-token common prefixes, a branch
at every turn), as ``test_cross_forward.py`` runs it on the Megatron engine, at budgets of 80
and 70: both groups cross micro-batches. Under FSDP every block is computed again in its
backward step (the prefix's graph is not kept: ``prefix_sharing.verl_ext.fsdp_cross``), so
every group nests, its tails packed under the whole budget. A control whose block backward
steps drop their readers' gradients fails.
"""

import contextlib
import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import actor_config, build_engine, save_model  # noqa: E402
from tests.verl_ext.test_cross_forward import BUDGETS, CROSS, batch  # noqa: E402

STRATEGIES = ("fsdp2", "fsdp")


def steps(rank: int, path: str, strategy: str, ulysses: int = 1) -> dict:
    """verl's stock step (feature off), the cross-micro-batch one per budget, and a control,
    each on a fresh engine from the same checkpoint; with ``ulysses`` the cross steps (not the
    stock one) under Ulysses over that many ranks, at the same tokens per micro-batch (verl's
    budget is ``max_token_len_per_gpu`` x the Ulysses size)."""
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from tests.megatron_ext._controls import blocks_take_no_gradients
    from tests.verl_ext._batch import plain_output, use_cpu_platform

    use_cpu_platform()
    results = {}
    runs = [(80, "off", None)] + [(budget, "cross", CROSS) for budget in BUDGETS]
    for budget, name, prefix_grouper in runs + [(70, "control", CROSS)]:
        sp = 1 if prefix_grouper is None else ulysses
        config = actor_config(prefix_grouper, strategy=strategy,
                              ulysses_sequence_parallel_size=sp)
        engine = build_engine(config, path)
        with engine.eval_mode():
            infer = engine.infer_batch(batch(budget // sp))
        rows = []  # each training forward's rows on this rank
        engine.module.register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["input_ids"].size(1)),
            with_kwargs=True)
        with engine.train_mode():  # zeroes the gradients on exit: gather them before
            with blocks_take_no_gradients() if name == "control" else contextlib.nullcontext():
                train = engine.forward_backward_batch(batch(budget // sp),
                                                      partial(ppo_loss, config=config))
            grads = full_gradients(engine.module)
        results[budget, name] = {"infer": plain_output(infer), "train": plain_output(train),
                                 "grads": grads, "engine": type(engine).__name__,
                                 "rows": rows}
    return results


@pytest.fixture(scope="module", params=[*STRATEGIES, "ulysses"])
def results(request, tmp_path_factory):
    path = save_model(str(tmp_path_factory.mktemp("qwen2")))
    strategy, ulysses = ("fsdp2", 2) if request.param == "ulysses" else (request.param, 1)
    return request.param, run_gloo(steps, 2, path, strategy, ulysses, timeout=900)


@pytest.mark.parametrize("budget", BUDGETS)
def test_log_probs_entropy_loss_and_every_gradient_equal_verls_stock_step(results, budget):
    strategy, ranks = results
    for rank, result in enumerate(ranks):
        cross = result[budget, "cross"]
        assert cross["engine"] == "PrefixSharingFSDPEngine"
        metrics = cross["train"]["metrics"]
        assert metrics["prefix_sharing/groups_split"] == [0.0]
        assert metrics["prefix_sharing/prefix_recomputes_avoided"][0] > 0
        assert metrics["prefix_sharing/cross_recomputed_tokens"][0] > 0  # the blocks, again
        # every block forward, block recompute and micro-batch: this rank's share of its rows
        sp = 2 if strategy == "ulysses" else 1
        assert sp * sum(cross["rows"]) >= metrics["prefix_sharing/tokens_computed"][0]
        assert max(cross["rows"]) <= -(-budget // sp) + 1
        # back in batch order; the loss is verl's global token mean, summed over micro-batches
        same_outputs(cross, result[80, "off"], f"{strategy} budget {budget} rank {rank}",
                     per_micro_batch=False)


def test_a_control_that_drops_the_readers_prefix_gradients_fails(results):
    strategy, ranks = results
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(ranks[0][70, "control"], ranks[0][80, "off"], f"{strategy} control",
                     per_micro_batch=False)
