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
