"""plan_group: a group cut into shared blocks and suffix micro-batches that address them."""

import pytest
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.batching import CostModel
from prefix_sharing.cross_micro_batch import plan_group
from prefix_sharing.workloads import make_workload

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
# one agent task: a 112-token prompt, a branch at every turn, 9 episodes (687 tokens)
GROUP = dict(num_tasks=1, num_turns=3, branching=3, system_len=96, task_len=(16, 17),
             turn_len=(6, 10), seed=3)


def _group():
    return make_workload("agent", **GROUP).sequences


def test_worked_example_of_the_module_doc():
    seqs = [torch.tensor(s) for s in ([5, 6, 7, 8, 9], [5, 6, 7, 8, 4], [5, 6, 7, 2])]
    schedule = plan_group(seqs, 100, EVERY_PREFIX)
    (suffix,) = schedule.suffixes
    plan = suffix.plan
    assert schedule.prefix_ids.tolist() == [5, 6, 7]
    assert plan.input_ids.tolist() == [9, 8, 4, 2]
    assert plan.position_ids.tolist() == [4, 3, 4, 3]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 3, 4]
    assert plan.cu_seqlens_kv.tolist() == [0, 5, 10, 14]
    assert plan.kv_gather_index.tolist() == [0, 1, 2, 4, 3, 0, 1, 2, 4, 5, 0, 1, 2, 6]
    assert plan.kv_index.tolist() == plan.kv_gather_index.tolist()
    assert plan.prefix_lens == (4, 3, 3)


def test_the_prefix_is_the_longest_common_one():
    seqs = _group()
    n = plan_group(seqs, 250, EVERY_PREFIX).prefix_len
    assert n >= 112  # the prompt, and any first-turn tokens all episodes happen to share
    assert all(torch.equal(s[:n], seqs[0][:n]) for s in seqs)
    assert len({int(s[n]) for s in seqs}) > 1


@pytest.mark.parametrize("budget", [150, 200, 250, 330])
def test_suffixes_fit_the_budget_and_address_prefix_then_own_rows(budget):
    seqs = _group()
    schedule = plan_group(seqs, budget, EVERY_PREFIX)
    assert 3 <= schedule.num_micro_batches <= 4
    for suffix in schedule.suffixes:
        plan = suffix.plan
        assert plan.num_tokens_unique <= budget
        rows = torch.cat([schedule.prefix_ids, plan.input_ids])  # external prefix rows, then own
        members = [seqs[i] for i in suffix.members]
        assert torch.equal(rows.index_select(0, plan.kv_index), torch.cat(members))
        # every key segment is its sequence's prefix: the whole sequence for a tail's owner
        keys = torch.split(rows.index_select(0, plan.kv_gather_index),
                           torch.diff(plan.cu_seqlens_kv).tolist())
        for seg, n in zip(keys, torch.diff(plan.cu_seqlens_q).tolist()):
            assert any(torch.equal(s[:seg.numel()], seg) for s in members)
            assert 1 <= n <= seg.numel() - schedule.prefix_len  # queries: a tail of its keys
        # the tails' own plan scores the same flat rows
        assert torch.equal(suffix.tail_plan.input_ids, plan.input_ids)
        assert torch.equal(suffix.tail_plan.position_ids + schedule.prefix_len, plan.position_ids)


def test_padded_suffixes_keep_their_addressing_and_pad_after_their_own_rows():
    """For sequence parallelism: each suffix's rows a multiple of 2; the pad segment's queries
    are the pad rows (after every real row), which no sequence reads."""
    seqs = _group()
    plain = plan_group(seqs, 200, EVERY_PREFIX)
    padded = plan_group(seqs, 200, EVERY_PREFIX, pad_to_multiple_of=2)
    assert any(s.plan.num_padding for s in padded.suffixes)
    for a, b in zip(plain.suffixes, padded.suffixes):
        assert a.members == b.members and b.plan.input_ids.numel() % 2 == 0
        assert torch.equal(a.plan.kv_index, b.plan.kv_index)
        n = a.plan.input_ids.numel()
        assert torch.equal(b.plan.input_ids[:n], a.plan.input_ids)
        assert torch.equal(b.plan.cu_seqlens_q[:-1], a.plan.cu_seqlens_q) if b.plan.num_padding \
            else torch.equal(b.plan.cu_seqlens_q, a.plan.cu_seqlens_q)
        assert b.plan.num_tokens_unique == a.plan.num_tokens_unique


def test_positions_cover_the_group_once_and_each_prefix_is_computed_once():
    seqs = _group()
    schedule = plan_group(seqs, 250, EVERY_PREFIX)
    positions = torch.cat([schedule.prefix_positions]
                          + [s.token_positions for s in schedule.suffixes])
    assert sorted(positions.tolist()) == list(range(sum(len(s) for s in seqs)))
    whole = build_plan(seqs, EVERY_PREFIX)
    assert schedule.tokens_unique == whole.num_tokens_unique
    assert schedule.tokens_computed == whole.num_tokens_unique
    for budget in (113, 150, 200, 330):  # a branch that fits alone is never cut
        assert plan_group(seqs, budget, EVERY_PREFIX).tokens_computed == whole.num_tokens_unique


def _branchy():
    prefix, branch = [1, 2, 3], [4]
    return [torch.tensor(prefix + branch + [5, 6, 7, 8]),
            torch.tensor(prefix + branch + [9, 10, 11, 12]), torch.tensor(prefix + [13])]


def test_one_level_cuts_a_branch_larger_than_the_budget_and_computes_it_in_each_piece():
    seqs = _branchy()
    schedule = plan_group(seqs, 6, EVERY_PREFIX, one_level=True)  # the branch computes 9 tokens
    assert schedule.one_level
    assert [s.members for s in schedule.suffixes] == [(0,), (1, 2)]
    assert schedule.tokens_unique == 3 + 1 + 8 + 1
    assert schedule.tokens_computed == schedule.tokens_unique + 1  # its first token twice
    assert schedule.prefix_recomputes_avoided == len(schedule.suffixes) - 1
    assert schedule.recomputed_tokens() == 1


def test_a_branch_larger_than_the_budget_is_a_sub_tree_with_its_own_shared_block():
    seqs = _branchy()
    schedule = plan_group(seqs, 6, EVERY_PREFIX)
    assert [(b.ids.tolist(), b.reads, b.members) for b in schedule.blocks] == [
        ([1, 2, 3], (), (0, 1, 2)), ([4], (0,), (0, 1))]
    assert [(s.members, s.reads) for s in schedule.suffixes] == [
        ((0,), (0, 1)), ((1,), (0, 1)), ((2,), (0,))]
    assert schedule.steps == (("forward", 0), ("forward", 1), ("suffix", 0), ("suffix", 1),
                              ("backward", 1), ("suffix", 2), ("backward", 0))
    assert schedule.tokens_computed == schedule.tokens_unique == 3 + 1 + 8 + 1
    assert schedule.recomputed_tokens() == 0 and schedule.recomputed_tokens(True) == 4
    assert schedule.prefix_recomputes_avoided == 2 + 1  # the prefix: 3 readers; [4]: 2
    _check_addressing(seqs, schedule, 6)


def _check_addressing(seqs, schedule, budget):
    """Every micro-batch is within the budget; its external rows (its read blocks' tokens, in
    order) then its own rows address its members' tokens; every position is scored once; a
    block's backward comes after each of its readers, and its readers after its forward."""
    blocks = schedule.blocks
    for b in blocks:
        assert b.length <= budget
        rows = torch.cat([blocks[r].ids for r in b.reads] + [b.ids])
        assert rows.numel() == b.end
        assert all(torch.equal(seqs[i][: b.end], rows) for i in b.members)
        assert torch.equal(b.plan.input_ids[: b.length], b.ids)
        assert torch.equal(b.plan.position_ids[: b.length], torch.arange(b.start, b.end))
    for suffix in schedule.suffixes:
        plan = suffix.plan
        assert plan.num_tokens_unique <= budget
        rows = torch.cat([blocks[r].ids for r in suffix.reads] + [plan.input_ids])
        assert torch.equal(rows.index_select(0, plan.kv_index),
                           torch.cat([seqs[i] for i in suffix.members]))
    positions = torch.cat([b.positions for b in blocks]
                          + [s.token_positions for s in schedule.suffixes])
    assert sorted(positions.tolist()) == list(range(sum(len(s) for s in seqs)))
    at = {step: k for k, step in enumerate(schedule.steps)}
    readers = [("forward", k, b.reads) for k, b in enumerate(blocks)] + [
        ("suffix", k, s.reads) for k, s in enumerate(schedule.suffixes)]
    for kind, k, reads in readers:
        for r in reads:
            assert at["forward", r] < at[kind, k] < at["backward", r]
            if kind == "forward":
                assert at["backward", k] < at["backward", r]


def test_worked_example_of_the_module_doc_under_a_budget_of_two():
    seqs = [torch.tensor(s) for s in ([5, 6, 7, 8, 9], [5, 6, 7, 8, 4], [5, 6, 7, 2])]
    schedule = plan_group(seqs, 2, EVERY_PREFIX)
    assert [(b.ids.tolist(), b.reads) for b in schedule.blocks] == [
        ([5, 6], ()), ([7], (0,)), ([8], (0, 1))]
    assert [(s.plan.input_ids.tolist(), s.reads) for s in schedule.suffixes] == [
        ([2], (0, 1)), ([9, 4], (0, 1, 2))]
    assert [kind for kind, _ in schedule.steps] == [
        "forward", "forward", "suffix", "forward", "suffix", "backward", "backward", "backward"]
    assert [b for kind, b in schedule.steps if kind == "backward"] == [2, 1, 0]
    assert schedule.tokens_computed == schedule.tokens_unique == 7
    _check_addressing(seqs, schedule, 2)


@pytest.mark.parametrize("budget", [30, 35, 40])
def test_a_prefix_of_several_budgets_is_chunked_each_chunk_reading_the_ones_before(budget):
    seqs = _group()  # a 113-token common prefix: 3-4 budgets
    schedule = plan_group(seqs, budget, EVERY_PREFIX)
    chunks = [b for b in schedule.blocks if b.node == 0]
    assert len(chunks) == -(-schedule.prefix_len // budget)  # the fewest the budget allows
    assert [b.reads for b in chunks] == [tuple(range(j)) for j in range(len(chunks))]
    assert torch.equal(torch.cat([b.ids for b in chunks]), schedule.prefix_ids)
    assert schedule.tokens_computed == schedule.tokens_unique  # every prefix once
    assert schedule.max_tokens_computed <= budget
    assert schedule.held_rows == max(b.end for b in schedule.blocks)
    _check_addressing(seqs, schedule, budget)


def test_chunk_boundaries_balance_the_cost_model():
    """Equal cost per chunk: with attention weighed heavily a later chunk (more keys) is
    shorter; with the default ratio the chunks are nearly equal in tokens."""
    seqs = [torch.cat([torch.arange(100), torch.tensor([t])]) for t in (200, 201)]
    lengths = [b.length for b in plan_group(seqs, 45, EVERY_PREFIX,
                                            cost_model=CostModel(keys_per_token=256)).blocks]
    assert sum(lengths) == 100 and len(lengths) == 3 and lengths[0] > lengths[1] > lengths[2]
    costs = [n + (n * a + n * (n + 1) / 2) / 256
             for n, a in zip(lengths, [0, lengths[0], lengths[0] + lengths[1]])]
    assert max(costs) - min(costs) <= 1 + (100 + 1) / 256  # within a token's cost of equal
    default = [b.length for b in plan_group(seqs, 40, EVERY_PREFIX).blocks]
    assert sum(default) == 100 and max(default) - min(default) <= 1


def test_a_two_level_tree_computes_every_prefix_once():
    """Agent episodes whose first turns branch again: sub-trees larger than the budget get
    their own shared blocks (reading the common prefix); every token of the tree once."""
    w = make_workload("agent", num_tasks=1, num_turns=3, branching=3, system_len=40,
                      task_len=(8, 9), turn_len=(20, 24), seed=3)
    seqs = w.sequences
    schedule = plan_group(seqs, 90, EVERY_PREFIX)
    nodes = {b.node for b in schedule.blocks}
    assert len(nodes) >= 3  # the common prefix and at least two sub-trees
    assert max(len(b.reads) for b in schedule.blocks if b.node) >= 1  # below the prefix
    assert schedule.tokens_computed == schedule.tokens_unique
    assert all(len(b.members) < len(seqs) for b in schedule.blocks if b.node)
    with pytest.raises(ValueError, match="tail after the common prefix"):
        plan_group(seqs, 90, EVERY_PREFIX, one_level=True)  # one level cannot run it
    _check_addressing(seqs, schedule, 90)


def test_metrics_a_trainer_logs():
    seqs = _group()
    schedule = plan_group(seqs, 150, EVERY_PREFIX)
    assert schedule.metrics() == {
        "prefix_sharing/num_micro_batches": 4.0,
        "prefix_sharing/tokens_computed": 444.0,
        "prefix_sharing/token_ratio": sum(len(s) for s in seqs) / 444,
        "prefix_sharing/prefix_recomputes_avoided": 2.0,
        "prefix_sharing/cross_recomputed_tokens": 0.0,
    }
    assert schedule.metrics(recompute_prefix=True)[
        "prefix_sharing/cross_recomputed_tokens"] == schedule.prefix_len


def test_prefix_stats_plan_reads_each_sequence_up_to_its_first_own_token():
    seqs = _group()
    schedule = plan_group(seqs, 250, EVERY_PREFIX)
    n = schedule.prefix_len
    stats = schedule.prefix_stats_plan
    assert torch.equal(stats.token_ids, torch.cat([s[: n + 1] for s in seqs]))
    keep = ~stats.is_last_token
    targets = torch.cat([s[1: n + 1] for s in seqs])
    assert torch.equal(stats.next_token_ids[keep], targets)


def test_refusals_name_the_problem():
    seqs = _group()
    with pytest.raises(ValueError, match=r"common prefix \(113 tokens\) exceeds token_budget=100; "
                       "with one_level=True"):
        plan_group(seqs, 100, EVERY_PREFIX, one_level=True)
    with pytest.raises(ValueError, match="tail after the common prefix"):
        plan_group([torch.arange(20), torch.cat([torch.arange(10), torch.arange(200, 300)])], 50,
                   one_level=True)
    with pytest.raises(ValueError, match="share no prefix"):
        plan_group([torch.tensor([1, 2]), torch.tensor([3, 4])], 50)
    with pytest.raises(ValueError, match="at least two sequences"):
        plan_group([torch.arange(5)], 50)
    with pytest.raises(ValueError, match="mode is 'off'"):
        plan_group(seqs, 500, PrefixSharingConfig(mode="off"))


@pytest.mark.parametrize("budget", [8, 12, 20])
def test_a_sequence_ending_one_token_into_a_sub_tree_recomputes_that_token_only(budget):
    """The tree workload: one sequence ends at the first token of a branch the others go on
    sharing; that token is computed again in its suffix, the rest of the tree once."""
    seqs = make_workload("tree").sequences
    schedule = plan_group(seqs, budget, EVERY_PREFIX)
    assert len({b.node for b in schedule.blocks}) >= 3
    assert schedule.tokens_distinct == schedule.tokens_unique
    assert schedule.tokens_computed == schedule.tokens_distinct + 1
    assert schedule.recomputed_tokens() == 1
    _check_addressing(seqs, schedule, budget)


def test_a_grpo_group_keeps_the_one_level_schedule():
    w = make_workload("grpo", num_prompts=1, group_size=6, prompt_len=(40, 41),
                      response_len=(12, 24), seed=5)
    schedule = plan_group(w.sequences, 70, EVERY_PREFIX)
    assert schedule.one_level and schedule.steps[0] == ("forward", 0)
    assert schedule.steps[-1] == ("backward", 0) and len(schedule.suffixes) >= 2
    assert all(s.reads == (0,) for s in schedule.suffixes)
    one_level = plan_group(w.sequences, 70, EVERY_PREFIX, one_level=True)
    assert [s.members for s in schedule.suffixes] == [s.members for s in one_level.suffixes]
    assert schedule.steps == one_level.steps


def test_a_schedule_with_routes_cuts_its_prefix_where_they_diverge():
    """With routes the common prefix ends where the members' routes diverge, and every block
    and suffix carries its rows' routes."""
    w = make_workload("grpo", num_prompts=1, group_size=6, prompt_len=(40, 41),
                      response_len=(12, 24), seed=5)
    routes = [torch.zeros(len(s), 1, 2, dtype=torch.int64) for s in w.sequences]
    routes[3][10, 0, 0] = 1  # one member's route diverges at token 10 of the prompt
    replayed = plan_group(w.sequences, 84, EVERY_PREFIX, one_level=True, routes=routes)
    assert replayed.one_level and replayed.blocks[0].length == 10
    assert torch.equal(replayed.blocks[0].routes, routes[0][:10])
    assert all(s.routes is not None for s in replayed.suffixes)
