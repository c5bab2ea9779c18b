"""verl's dynamic-batch-size split with sharing on: groups kept together, verl's contract kept.

Runs against the installed verl (0.8.0 or 0.9.1: the split function is the same in both) through
verl's own ``prepare_micro_batches``, on no-padding batches built as verl's trainer builds them.
"""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

import torch  # noqa: E402

from prefix_sharing import PrefixSharingConfig, build_plan, prompt_groups  # noqa: E402
from prefix_sharing.verl_ext.microbatch import add_split_metrics, sharing_split  # noqa: E402
from tests.verl_ext._batch import make_batch, use_cpu_platform  # noqa: E402

ARBITRARY = PrefixSharingConfig(min_prefix_len=1)
PROMPT_ONLY = PrefixSharingConfig(mode="prompt_only", min_prefix_len=1)
BUDGET = 70  # the GRPO batch: 6 samples, 138 tokens, 2 prompts of 3 responses


@pytest.fixture(scope="module")
def verl():
    use_cpu_platform()
    from verl.utils import seqlen_balancing, tensordict_utils
    from verl.workers.engine import utils as engine_utils

    return engine_utils, seqlen_balancing, tensordict_utils


def dynamic(batch, tu, budget=BUDGET, **extra):
    tu.assign_non_tensor(batch, use_dynamic_bsz=True, max_token_len_per_gpu=budget, **extra)
    return batch


def split_groups(index_lists, uids):
    """uids whose samples landed in more than one micro-batch."""
    return {u for u in set(uids) if sum(any(uids[i] == u for i in mb) for mb in index_lists) > 1}


def sequences(batch):
    return list(batch["input_ids"].unbind())


def test_the_patch_set_points_prepare_micro_batches_at_the_sharing_split(verl):
    engine_utils, seqlen_balancing, _ = verl
    assert engine_utils.rearrange_micro_batches._prefix_sharing_stock is (
        seqlen_balancing.rearrange_micro_batches)


def test_without_sharing_verls_own_split_runs_and_scatters_groups(verl):
    engine_utils, seqlen_balancing, tu = verl
    batch = dynamic(make_batch("grpo"), tu)
    _, stock = seqlen_balancing.rearrange_micro_batches(batch, max_token_len=BUDGET)
    for config in (None, PrefixSharingConfig(mode="off")):
        if config is None:
            _, index_lists = engine_utils.prepare_micro_batches(batch)
        else:
            with sharing_split(config) as record:
                _, index_lists = engine_utils.prepare_micro_batches(batch)
            assert record.split is None and record.metrics() == {}
        assert index_lists == stock
    assert split_groups(stock, tu.get(batch, "uid")), "verl's split kept every group: no problem shown"


def test_sharing_keeps_uid_groups_together_under_the_budget_and_verl_restores_the_order(verl):
    engine_utils, seqlen_balancing, tu = verl
    batch = dynamic(make_batch("grpo"), tu)
    with sharing_split(ARBITRARY) as record:
        micro_batches, index_lists = engine_utils.prepare_micro_batches(batch)
    uids, seqs = tu.get(batch, "uid"), sequences(batch)
    assert not split_groups(index_lists, uids) and record.split.groups_split == 0
    for mb, idx in zip(micro_batches, index_lists, strict=True):
        assert [list(map(int, s)) for s in sequences(mb)] == [seqs[i].tolist() for i in idx]
        assert tu.get(mb, "uid") == [uids[i] for i in idx]
        assert build_plan(sequences(mb), ARBITRARY).num_tokens_unique <= BUDGET
    outputs = torch.nested.as_nested_tensor(
        [s for mb in micro_batches for s in sequences(mb)], layout=torch.jagged)
    restored = seqlen_balancing.restore_dynamic_batch(outputs, index_lists)
    assert all(torch.equal(a, b) for a, b in zip(restored.unbind(), seqs, strict=True))
    metrics = record.metrics()
    assert metrics["prefix_sharing/groups_split"] == 0.0
    assert metrics["prefix_sharing/num_micro_batches"] == len(index_lists)
    assert metrics["prefix_sharing/token_ratio"] == pytest.approx(
        sum(map(len, seqs)) / sum(record.split.tokens_computed))


def test_a_shared_micro_batch_carries_more_samples_than_verls_under_the_same_budget(verl):
    engine_utils, seqlen_balancing, tu = verl
    batch = dynamic(make_batch("grpo"), tu, budget=110)  # 138 tokens in all, 107 computed
    _, stock = seqlen_balancing.rearrange_micro_batches(batch, max_token_len=110)
    with sharing_split(ARBITRARY):
        _, index_lists = engine_utils.prepare_micro_batches(batch)
    assert (len(stock), len(index_lists)) == (2, 1)


def test_a_tree_without_uid_is_grouped_by_its_prefixes_and_a_forced_cut_is_reported(verl):
    engine_utils, _, tu = verl
    batch = make_batch("tree")
    tu.pop(batch, "uid")
    whole = build_plan(sequences(batch), ARBITRARY).num_tokens_unique
    budget = whole - 1  # the tree does not fit: it must be cut once
    dynamic(batch, tu, budget=max(budget, max(map(len, sequences(batch)))))
    with sharing_split(ARBITRARY) as record:
        micro_batches, index_lists = engine_utils.prepare_micro_batches(batch)
    assert record.split.num_groups == 1 and record.split.groups_split == 1
    for mb in micro_batches:
        assert build_plan(sequences(mb), ARBITRARY).num_tokens_unique <= budget


def test_the_micro_batch_count_follows_verls_contract(verl):
    engine_utils, _, tu = verl
    batch = dynamic(make_batch("grpo"), tu, budget=10_000)  # one micro-batch would do
    with sharing_split(ARBITRARY):
        _, index_lists = engine_utils.prepare_micro_batches(batch, min_num_micro_batch=3,
                                                            num_batches_divided_by=2)
    assert len(index_lists) == 4  # at least 3, rounded up to the virtual-pipeline multiple
    assert sorted(i for mb in index_lists for i in mb) == list(range(6))
    with sharing_split(ARBITRARY), pytest.raises(ValueError, match="holds only 6 samples"):
        engine_utils.prepare_micro_batches(batch, min_num_micro_batch=5, num_batches_divided_by=4)
    longest = max(map(len, sequences(batch)))
    with sharing_split(ARBITRARY), pytest.raises(ValueError, match=f"longest sequence .{longest} "):
        engine_utils.prepare_micro_batches(dynamic(batch, tu, budget=longest - 1))


def test_prompt_only_budgets_each_uid_prompt_once(verl):
    engine_utils, _, tu = verl
    batch = dynamic(make_batch("steprl"), tu, budget=10_000)
    with sharing_split(PROMPT_ONLY) as record:
        _, index_lists = engine_utils.prepare_micro_batches(batch)
    mask, resp = batch["attention_mask"], batch["response_mask"]
    prompt_lens = mask[:, : mask.size(1) - resp.size(1)].sum(1).tolist()
    expected = build_plan(sequences(batch), PROMPT_ONLY,
                          groups=prompt_groups(tu.get(batch, "uid"), prompt_lens))
    assert record.split.tokens_computed == (expected.num_tokens_unique,)
    tu.pop(batch, "uid")
    with sharing_split(PROMPT_ONLY), pytest.raises(ValueError, match="batch has no 'uid' field"):
        engine_utils.prepare_micro_batches(batch)


def test_fixed_groups_of_force_group_size_keep_verls_split(verl):
    engine_utils, seqlen_balancing, tu = verl
    batch = dynamic(make_batch("grpo"), tu, force_group_size=3)
    _, stock = seqlen_balancing.rearrange_micro_batches(batch, max_token_len=BUDGET,
                                                        force_group_size=3)
    with sharing_split(ARBITRARY) as record:
        _, index_lists = engine_utils.prepare_micro_batches(batch)
    assert index_lists == stock and record.split is None


def test_split_metrics_join_verls_metrics_without_replacing_measured_ones(verl):
    engine_utils, _, tu = verl
    with sharing_split(ARBITRARY) as record:
        engine_utils.prepare_micro_batches(dynamic(make_batch("grpo"), tu))
    output = {"metrics": {"prefix_sharing/token_ratio": [0.5], "actor/pg_loss": [1.0, 2.0]}}
    add_split_metrics(output, record)
    assert output["metrics"]["prefix_sharing/token_ratio"] == [0.5]
    assert output["metrics"]["prefix_sharing/groups_split"] == [0.0]
    assert all(isinstance(v, list) for v in output["metrics"].values())  # verl flattens lists


def _count_on_rank(rank: int, budgets: list[int]) -> list[list[int]]:
    """One data-parallel rank's split (its own batch size budget), inside a sharing step."""
    from megatron.core import parallel_state

    from tests.verl_ext import _engine  # noqa: F401 - imports verl's engines in a megatron rank

    use_cpu_platform()
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine import utils as engine_utils

    batch = dynamic(make_batch("grpo"), tu, budget=budgets[rank])
    with sharing_split(ARBITRARY):
        _, index_lists = engine_utils.prepare_micro_batches(
            batch, dp_group=parallel_state.get_data_parallel_group())
    return index_lists


def test_data_parallel_ranks_agree_on_the_micro_batch_count():
    from prefix_sharing.engines.launch import run_distributed

    # rank 0 needs two micro-batches, rank 1 one: both run two (verl's same_micro_num_in_dp)
    ranks = run_distributed(_count_on_rank, 2, [70, 10_000], timeout=300)
    assert [len(r) for r in ranks] == [2, 2]
    assert all(sorted(i for mb in r for i in mb) == list(range(6)) for r in ranks)


# --- fixed micro-batches (use_dynamic_bsz: false) ---------------------------------------------

INTERLEAVED = [0, 3, 1, 4, 2, 5]  # the GRPO batch's two groups of 3, alternating


def ppo(**settings):
    """verl's ``ppo_loss`` bound to an actor config, as verl's worker binds it."""
    from functools import partial

    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    section = dict(_target_="verl.workers.config.FSDPActorConfig", strategy="fsdp2",
                   rollout_n=3, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                   **settings)
    return partial(ppo_loss, config=omega_conf_to_dataclass(OmegaConf.create(section)))


def fixed_interleaved(tu):
    return tu.index_select_tensor_dict(make_batch("grpo", micro_batch_size=3), INTERLEAVED)


@pytest.mark.parametrize("config", [ARBITRARY, PROMPT_ONLY], ids=["arbitrary", "prompt_only"])
def test_fixed_micro_batches_put_each_group_in_one_chunk_and_back(verl, config):
    from prefix_sharing.verl_ext.microbatch import (fixed_order, restore_sample_order,
                                                    select_samples)

    engine_utils, _, tu = verl
    batch = fixed_interleaved(tu)
    with sharing_split(config) as record:
        order = fixed_order(batch, record, ppo(), forward_only=False)
    assert order == [0, 2, 4, 1, 3, 5]
    assert record.split.groups_split == 0 and record.split.token_budget == 0
    chunks, _ = engine_utils.prepare_micro_batches(select_samples(batch, order))  # verl's own
    uids = tu.get(batch, "uid")
    assert [set(tu.get(mb, "uid")) for mb in chunks] == [{uids[0]}, {uids[1]}]
    # per-sample outputs computed in that order come back in the batch's order
    output = {"model_output": {"ids": select_samples(batch, order)["input_ids"]}}
    restore_sample_order(output, order)
    for got, want in zip(output["model_output"]["ids"].unbind(), batch["input_ids"].unbind()):
        assert torch.equal(got, want)


def test_fixed_micro_batches_keep_verls_order_where_it_already_keeps_the_groups(verl):
    from prefix_sharing.verl_ext.microbatch import fixed_order

    _, _, tu = verl
    batch = make_batch("grpo", micro_batch_size=3)
    with sharing_split(ARBITRARY) as record:
        assert fixed_order(batch, record, ppo(), forward_only=False) is None
    assert record.split.groups_split == 0 and len(record.split.micro_batches) == 2
    with sharing_split(PrefixSharingConfig(mode="off")) as record:  # sharing off: verl's own
        assert fixed_order(fixed_interleaved(tu), record, ppo(), forward_only=False) is None


@pytest.mark.parametrize("settings, problem", [
    ({}, None),
    (dict(loss_agg_mode="seq-mean-token-sum"), None),
    (dict(loss_agg_mode="seq-mean-token-mean"), None),  # the batch carries global_batch_size
    (dict(policy_loss={"loss_mode": "gspo"}), None),
    (dict(policy_loss={"loss_mode": "geo_mean"}), "loss_mode='geo_mean' depends on its"),
    (dict(policy_loss={"loss_mode": "clip_cov"}), "loss_mode='clip_cov' depends on its"),
])
def test_a_loss_that_depends_on_the_micro_batch_keeps_verls_order_and_counts_its_cuts(
        verl, settings, problem):
    from prefix_sharing.verl_ext.microbatch import fixed_order, loss_order_problem

    _, _, tu = verl
    batch, loss = fixed_interleaved(tu), ppo(**settings)
    found = loss_order_problem(loss, batch)
    assert (found is None) if problem is None else (problem in found), found
    with sharing_split(ARBITRARY) as record:
        order = fixed_order(batch, record, loss, forward_only=False)
    assert (order is None) == (problem is not None)
    assert record.split.groups_split == (0 if problem is None else 2)
    with sharing_split(ARBITRARY) as record:  # a forward-only step has no loss to change
        assert fixed_order(batch, record, loss, forward_only=True) is not None


@pytest.mark.parametrize("loss_mode", ["vanilla", "geo_mean"])
def test_dynamic_bsz_keeps_verls_split_where_the_loss_depends_on_its_micro_batches(
        verl, loss_mode):
    """GMPO's ``geo_mean`` (a mean over the micro-batch's sequences): verl's own split, shared
    within; a sample-wise loss, and every forward-only step, keep the groups together."""
    from prefix_sharing.verl_ext.microbatch import dynamic_split_problem

    engine_utils, seqlen_balancing, tu = verl
    batch = dynamic(make_batch("grpo"), tu)
    loss = ppo(policy_loss={"loss_mode": loss_mode})
    _, stock = seqlen_balancing.rearrange_micro_batches(batch, max_token_len=BUDGET)
    for forward_only in (False, True):
        with sharing_split(ARBITRARY) as record:
            found = dynamic_split_problem(batch, record, loss, forward_only)
            _, index_lists = engine_utils.prepare_micro_batches(batch)
        kept = loss_mode == "geo_mean" and not forward_only
        assert (found is not None) == kept and (record.split is None) == kept
        if kept:
            assert index_lists == stock and "geo_mean" in found
        else:
            assert not split_groups(index_lists, tu.get(batch, "uid"))


def test_the_loss_order_rules_for_other_losses_and_global_figures(verl):
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    from prefix_sharing.verl_ext.microbatch import loss_order_problem

    _, _, tu = verl
    batch = fixed_interleaved(tu)
    assert loss_order_problem(None, batch) is None
    assert loss_order_problem(partial(sft_loss, config=None), batch) is None
    assert "not known to be a sum over samples" in loss_order_problem(lambda **_: 0, batch)
    tu.assign_non_tensor(batch, global_batch_size=None)
    assert "without the trainer's global_batch_size" in loss_order_problem(
        ppo(loss_agg_mode="seq-mean-token-sum"), batch)


@pytest.mark.parametrize("moe, reordered", [
    (dict(), True),
    (dict(num_moe_experts=4, moe_aux_loss_coeff=0.0), True),
    (dict(num_moe_experts=4, moe_aux_loss_coeff=0.01), False),
    (dict(num_moe_experts=4, moe_aux_loss_coeff=[0.0, 0.01]), False),
    (dict(num_moe_experts=4, moe_z_loss_coeff=1e-3), False),
])
def test_the_megatron_engine_keeps_verls_order_under_a_per_micro_batch_router_loss(
        verl, moe, reordered):
    from types import SimpleNamespace

    import verl.workers.engine.megatron.transformer_impl as megatron_engine

    from prefix_sharing.verl_ext.microbatch import fixed_order

    _, _, tu = verl
    engine = SimpleNamespace(tf_config=SimpleNamespace(**moe))
    problem = megatron_engine.PrefixSharingMegatronEngine.order_sensitive_statistics(engine)
    with sharing_split(ARBITRARY) as record:
        order = fixed_order(fixed_interleaved(tu), record, ppo(), False, problem)
    assert (order is not None) == reordered, problem
