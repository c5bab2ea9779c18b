"""build_plan: what is shared, how the flat layout looks, and what is refused."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, PromptGroup, build_plan, prompt_groups
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def ids(*values):
    return torch.tensor(values)


def test_worked_example_of_the_plan_docstring():
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]], EVERY_PREFIX)
    assert plan.input_ids.tolist() == [5, 6, 7, 8, 9, 9]
    assert plan.position_ids.tolist() == [0, 1, 2, 3, 3, 4]
    assert plan.cu_seqlens_q.tolist() == [0, 4, 6]
    assert plan.cu_seqlens_kv.tolist() == [0, 4, 9]
    assert plan.cu_seqlens_q.dtype == plan.cu_seqlens_kv.dtype == torch.int32
    assert (plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host) == ((0, 4, 6), (0, 4, 9))
    assert all(type(b) is int for b in plan.cu_seqlens_q_host + plan.cu_seqlens_kv_host)
    assert plan.kv_gather_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 5]
    assert plan.kv_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1]
    assert plan.prefix_lens == (0, 3, 2)
    assert (plan.max_seqlen_q, plan.max_seqlen_kv) == (4, 5)
    assert (plan.num_tokens_total, plan.num_tokens_unique) == (11, 6)


def test_grpo_group_computes_its_prompt_once():
    prompt = list(range(10, 30))
    seqs = [prompt + [1, 2, 3], prompt + [4, 5], prompt + [6]]
    plan = build_plan(seqs)
    assert plan.num_tokens_unique == 20 + 3 + 2 + 1
    assert sorted(plan.prefix_lens) == [0, 20, 20]
    assert plan.max_seqlen_kv == 23


def test_step_chain_reuses_each_previous_step():
    steps = [list(range(10, 20)), list(range(30, 38)), list(range(40, 49))]
    seqs = [sum(steps[: k + 1], []) for k in range(3)]  # 10, 18, 27 tokens
    plan = build_plan(seqs)
    assert plan.num_tokens_unique == 27
    # the longest sequence computes everything; the shorter ones are strict prefixes of it
    assert plan.prefix_lens == (10, 18, 0)
    assert plan.cu_seqlens_q.tolist() == [0, 27]


def test_duplicates_and_strict_prefixes_own_nothing():
    base = list(range(1, 13))
    plan = build_plan([base, base, base[:9], base + [50]], EVERY_PREFIX)
    assert plan.num_tokens_unique == 13
    assert plan.prefix_lens == (12, 12, 9, 0)
    assert plan.cu_seqlens_q.numel() == 2  # a single query segment: the longest sequence
    assert plan.restore(plan.input_ids).tolist() == base + base + base[:9] + base + [50]


def test_min_prefix_len_recomputes_short_prefixes():
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]
    assert build_plan([a, b], PrefixSharingConfig(min_prefix_len=3)).prefix_lens == (0, 3)
    assert build_plan([a, b], PrefixSharingConfig(min_prefix_len=4)).prefix_lens == (0, 0)


def test_min_group_size_keeps_only_prefixes_held_by_enough_sequences():
    common = list(range(1, 11))
    pair = common + list(range(20, 30))  # 20 tokens held by two sequences, 10 by three
    seqs = [pair + [1], pair + [2], common + [3]]
    assert build_plan(seqs, PrefixSharingConfig(min_group_size=2)).num_tokens_unique == 20 + 2 + 1
    plan = build_plan(seqs, PrefixSharingConfig(min_group_size=3))
    assert sorted(plan.prefix_lens) == [0, 10, 10]
    assert build_plan(seqs, PrefixSharingConfig(min_group_size=4)).prefix_lens == (0, 0, 0)


def test_off_mode_is_the_plain_packed_layout():
    seqs = [[1, 2, 3], [1, 2, 3], [1, 2]]
    plan = build_plan(seqs, PrefixSharingConfig(mode="off"))
    assert not plan.has_sharing
    assert plan.input_ids.tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    assert plan.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert plan.cu_seqlens_q.tolist() == plan.cu_seqlens_kv.tolist() == [0, 3, 6, 8]
    assert plan.kv_index.tolist() == list(range(8))


class TestPromptOnly:
    prompt = list(range(40, 50))

    def batch(self):
        return [self.prompt + [1, 2], self.prompt + [3], [7] * 12, self.prompt]

    def test_members_after_the_first_reuse_the_prompt(self):
        plan = build_plan(self.batch(), PrefixSharingConfig(mode="prompt_only"),
                          groups=[(10, [0, 1, 3]), (12, [2])])
        assert plan.prefix_lens == (0, 10, 0, 10)
        assert plan.num_tokens_unique == 12 + 1 + 12
        assert plan.restore(plan.input_ids).tolist() == sum(self.batch(), [])

    def test_only_the_prompt_is_shared_even_where_responses_agree(self):
        seqs = [self.prompt + [1, 2, 3], self.prompt + [1, 2, 4]]
        plan = build_plan(seqs, PrefixSharingConfig(mode="prompt_only"), groups=[(10, [0, 1])])
        assert plan.prefix_lens == (0, 10)

    def test_small_groups_and_short_prompts_are_not_shared(self):
        config = PrefixSharingConfig(mode="prompt_only", min_group_size=3)
        assert build_plan(self.batch()[:2], config, groups=[(10, [0, 1])]).prefix_lens == (0, 0)
        config = PrefixSharingConfig(mode="prompt_only", min_prefix_len=11)
        assert build_plan(self.batch()[:2], config, groups=[(10, [0, 1])]).prefix_lens == (0, 0)

    def test_groups_from_verl_uids(self):
        groups = prompt_groups(["a", "b", "a", "b"], [10, 3, 10, 3])
        assert groups == [PromptGroup(10, [0, 2]), PromptGroup(3, [1, 3])]
        with pytest.raises(ValueError, match="uid 'a' has members with different prompt lengths"):
            prompt_groups(["a", "a"], [10, 11])

    @pytest.mark.parametrize(
        "groups, message",
        [
            (None, "mode='prompt_only' needs groups"),
            ([(10, [0, 1]), (10, [1, 3])], "groups 0 and 1 both contain sequence 1"),
            ([(10, [0, 4])], "member index 4 is outside the batch of 4 sequences"),
            ([(10, [0, 2])], "sequence 2 does not start with the same 10 prompt tokens"),
            ([(11, [0, 3])], "sequence 3 has 10 tokens, fewer than the group's prompt_len 11"),
            ([(10, [])], "group 0 has no members"),
            ([(10, [0, 0])], "lists a member twice"),
            ([(-1, [0])], "prompt_len must be an integer >= 0"),
            ([10], r"must be a \(prompt_len, members\) pair"),
        ],
    )
    def test_inconsistent_groups_are_refused(self, groups, message):
        with pytest.raises(ValueError, match=message):
            build_plan(self.batch(), PrefixSharingConfig(mode="prompt_only"), groups=groups)

    def test_groups_with_another_mode_are_refused(self):
        with pytest.raises(ValueError, match="groups= is only used by mode='prompt_only'"):
            build_plan(self.batch(), groups=[(10, [0, 1])])


@pytest.mark.parametrize(
    "sequences, error, message",
    [
        ([], ValueError, "at least one sequence; got an empty batch"),
        ([[1, 2], []], ValueError, "sequence 1 is empty"),
        ([[1, 2], [1.5, 2.0]], ValueError, "sequence 1 has non-integer token ids"),
        ([[True, False]], ValueError, "sequence 0 has non-integer token ids"),
        ([[1, 2], [3, -4]], ValueError, r"token ids must lie in \[0, 2147483647\]; found -4"),
        ([[2**31]], ValueError, "found 2147483648"),
        ([[[1, 2], [3, 4]]], ValueError, r"sequence 0 must be 1-D token ids; got shape \(2, 2\)"),
        ([[1, [2, 3]]], ValueError, "sequence 0 is not a flat list of integer token ids"),
        ([["a", "b"]], ValueError, "sequence 0 is not a flat list of integer token ids"),
        (torch.zeros(2, 3, dtype=torch.long), TypeError, "got a 2-D Tensor"),
    ],
)
def test_bad_input_gets_one_clear_error(sequences, error, message):
    with pytest.raises(error, match=message):
        build_plan(sequences)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="config must be a PrefixSharingConfig"):
        build_plan([[1]], {"mode": "off"})
    with pytest.raises(ValueError, match="pad_to_multiple_of must be an integer >= 1; got 0"):
        build_plan([[1]], pad_to_multiple_of=0)


def test_tensors_arrays_and_lists_give_the_same_plan():
    seqs = [list(range(1, 12)), list(range(1, 10)) + [3, 3, 3]]
    as_lists = build_plan(seqs)
    as_arrays = build_plan([np.array(s, dtype=np.int32) for s in seqs])
    as_tensors = build_plan([torch.tensor(s, dtype=torch.int32) for s in seqs])
    assert as_lists.digest() == as_arrays.digest() == as_tensors.digest()
    assert as_tensors.input_ids.dtype == torch.int64


def test_padding_adds_an_isolated_causal_segment():
    plan = build_plan([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7]], EVERY_PREFIX, pad_to_multiple_of=4)
    assert plan.num_tokens_unique == 7 and plan.num_padding == 1 and plan.num_tokens_flat == 8
    assert plan.cu_seqlens_q.tolist() == [0, 5, 7, 8]
    assert plan.cu_seqlens_kv.tolist() == [0, 5, 11, 12]
    assert plan.kv_gather_index[-1].item() == 7  # the pad row attends only to itself
    assert plan.kv_index.max().item() < 7  # and no real token ever reads it


def test_plan_is_identical_in_another_process():
    code = (
        "from prefix_sharing.workloads import make_workload as m;"
        "from prefix_sharing import build_plan;"
        "print(build_plan(m('tree').sequences).digest())"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    from prefix_sharing.workloads import make_workload

    assert other.stdout.strip() == build_plan(make_workload("tree").sequences).digest()


# ------------------------------------------------------------------ properties of every plan
def check_plan_invariants(seqs: list[list[int]], plan, config: PrefixSharingConfig) -> None:
    lengths = [len(s) for s in seqs]
    # the host boundaries are the tensors' (padding segment included)
    assert plan.cu_seqlens_q_host == tuple(plan.cu_seqlens_q.tolist())
    assert plan.cu_seqlens_kv_host == tuple(plan.cu_seqlens_kv.tolist())
    flat = plan.input_ids.tolist()
    rows = plan.kv_index.tolist()
    positions = plan.position_ids.tolist()
    # every token of every sequence is restored, from a row computed at its own position
    assert plan.restore(plan.input_ids).tolist() == sum(seqs, [])
    offsets = np.cumsum([0] + lengths)
    owner_of_row = {}
    for r, s in enumerate(seqs):
        for j in range(len(s)):
            row = rows[offsets[r] + j]
            assert positions[row] == j
            owner_of_row.setdefault(row, (r, j))
            # ...and the row's whole causal context is this sequence's context
            r0, _ = owner_of_row[row]
            assert seqs[r0][: j + 1] == s[: j + 1]
    assert len(owner_of_row) == plan.num_tokens_unique == len(flat) - plan.num_padding
    # segments: non-empty queries that are the tail of their keys (bottom-right alignment)
    cq, ck = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist()
    gather = plan.kv_gather_index.tolist()
    if plan.num_padding:  # the last segment is the padding, attending only to itself
        assert cq[-1] - cq[-2] == ck[-1] - ck[-2] == plan.num_padding
        assert gather[ck[-2]:] == list(range(cq[-2], cq[-1]))
        cq, ck = cq[:-1], ck[:-1]
    for qs, qe, ks, ke in zip(cq, cq[1:], ck, ck[1:]):
        assert 0 < qe - qs <= ke - ks
        assert gather[ke - (qe - qs) : ke] == list(range(qs, qe))
        segment_tokens = [flat[i] for i in gather[ks:ke]]
        assert [positions[i] for i in gather[ks:ke]] == list(range(ke - ks))
        assert segment_tokens in seqs
    assert plan.max_seqlen_q >= max(b - a for a, b in zip(cq, cq[1:]))
    assert plan.max_seqlen_kv >= max(b - a for a, b in zip(ck, ck[1:]))
    if not plan.num_padding:
        assert plan.max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
        assert plan.max_seqlen_kv == max(b - a for a, b in zip(ck, ck[1:]))
    # what is shared obeys the config
    for p in plan.prefix_lens:
        assert p == 0 or p >= config.min_prefix_len
    for r, p in enumerate(plan.prefix_lens):
        if p:
            holders = sum(1 for s in seqs if s[:p] == seqs[r][:p])
            assert holders >= config.min_group_size


@given(forests(), st.integers(1, 3), st.integers(2, 4))
def test_plan_invariants_hold_on_random_forests(seqs, min_prefix_len, min_group_size):
    config = PrefixSharingConfig(min_prefix_len=min_prefix_len, min_group_size=min_group_size)
    check_plan_invariants(seqs, build_plan(seqs, config), config)


@given(forests())
def test_sharing_every_prefix_computes_each_trie_node_once(seqs):
    distinct_prefixes = {tuple(s[: j + 1]) for s in seqs for j in range(len(s))}
    assert build_plan(seqs, EVERY_PREFIX).num_tokens_unique == len(distinct_prefixes)


@given(forests(), st.integers(1, 8))
def test_padding_never_changes_the_real_rows(seqs, multiple):
    plain, padded = build_plan(seqs, EVERY_PREFIX), build_plan(seqs, EVERY_PREFIX, pad_to_multiple_of=multiple)
    assert padded.num_tokens_flat % multiple == 0
    assert torch.equal(padded.kv_index, plain.kv_index)
    assert torch.equal(padded.input_ids[: plain.num_tokens_flat], plain.input_ids)
    check_plan_invariants(seqs, padded, EVERY_PREFIX)


@pytest.mark.parametrize("workload", ["grpo", "steprl", "agent"])
def test_prompt_only_computes_what_prefix_grouper_computes(workload):
    """PrefixGrouper (the peer this mode follows) lays a group out as its prompt once plus every
    response; the prompt-only plan computes exactly those tokens."""
    from prefix_grouper import PrefixGrouper

    from prefix_sharing.workloads import make_workload

    w = make_workload(workload)
    group_info = [[g.prompt_len] + [len(w.sequences[m]) - g.prompt_len for m in g.members]
                  for g in w.groups]
    grouped_tokens = int(PrefixGrouper(group_info, device="cpu").total_lens.sum())
    config = PrefixSharingConfig(mode="prompt_only", min_prefix_len=1)
    assert build_plan(w.sequences, config, groups=w.groups).num_tokens_unique == grouped_tokens


# ----------------------------------------------------------------------------- routing replay
def routes_of(seqs, layers=2, topk=2, experts=8):
    """Batch-invariant routes: a function of the token prefix alone (what a deterministic
    rollout engine records), ``[L, layers, topk]`` per sequence."""
    out = []
    for s in seqs:
        rows = []
        for j in range(len(s)):
            h = hash(tuple(s[: j + 1]))
            rows.append([[(h >> (3 * (layer * topk + k))) % experts for k in range(topk)]
                         for layer in range(layers)])
        out.append(np.asarray(rows, dtype=np.int64))
    return out


def test_routes_that_agree_give_the_tokens_plan():
    seqs = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]
    by_tokens = build_plan(seqs, EVERY_PREFIX)
    with_routes = build_plan(seqs, EVERY_PREFIX, routes=routes_of(seqs))
    assert with_routes.digest() == by_tokens.digest()
    assert with_routes.route_divergent_prefix_tokens == 0


def test_a_route_mismatch_ends_the_shared_prefix_at_that_token():
    seqs = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [5, 6]]
    routes = routes_of(seqs)
    routes[1][1, 1, 0] += 1  # sequence 1's second token went elsewhere on layer 1
    plan = build_plan(seqs, EVERY_PREFIX, routes=routes)
    assert plan.prefix_lens == (0, 1, 2)  # b shares [5] only; c still shares a's [5 6]
    assert plan.num_tokens_unique == 4 + 4
    assert plan.route_divergent_prefix_tokens == 2  # b's tokens 6 and 7 are computed again
    assert plan.input_ids.tolist() == [5, 6, 7, 8, 6, 7, 9, 9]


def test_prompt_only_shares_a_prompt_as_far_as_the_routes_agree():
    seqs = [[1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 3, 4, 12]]
    routes = routes_of(seqs)
    routes[2][2, 0, 1] += 1
    config = PrefixSharingConfig(mode="prompt_only", min_prefix_len=2)
    plan = build_plan(seqs, config, groups=[(4, [0, 1, 2])], routes=routes)
    assert plan.prefix_lens == (0, 4, 2)
    assert plan.route_divergent_prefix_tokens == 2
    routes[2][1, 0, 1] += 1  # now it agrees on one token only: below min_prefix_len
    assert build_plan(seqs, config, groups=[(4, [0, 1, 2])], routes=routes).prefix_lens == (0, 4, 0)


@given(forests(), st.integers(1, 3), st.integers(2, 3), st.data())
def test_every_computed_row_stands_for_tokens_with_one_route(seqs, min_prefix_len,
                                                             min_group_size, data):
    """Perturbed routes (any token of any sequence): every plain token that reads a flat row
    has that row's route, and the plan obeys every other invariant."""
    config = PrefixSharingConfig(min_prefix_len=min_prefix_len, min_group_size=min_group_size)
    routes = routes_of(seqs, layers=1, topk=1, experts=3)
    for r in data.draw(st.lists(st.integers(0, len(seqs) - 1), max_size=3)):
        j = data.draw(st.integers(0, len(seqs[r]) - 1))
        routes[r][j, 0, 0] += 1
    plan = build_plan(seqs, config, routes=routes)
    check_plan_invariants(seqs, plan, config)
    packed = np.concatenate(routes).reshape(plan.num_tokens_total, -1)
    kv = plan.kv_index.numpy()
    first = np.full(plan.num_tokens_flat, -1)
    first[kv[::-1]] = np.arange(kv.size)[::-1]
    assert (packed == packed[first[kv]]).all()
    by_tokens = build_plan(seqs, config)
    assert plan.route_divergent_prefix_tokens == plan.num_tokens_unique - by_tokens.num_tokens_unique


@pytest.mark.parametrize("routes, message", [
    ([np.zeros((4, 2), int)], r"one array per sequence \(2\); got 1 arrays"),
    ([np.zeros((4, 2), int), np.zeros((4, 2), int)],
     r"routes of sequence 1 have shape \(4, 2\); expected \(5, \*\(2,\)\)"),
    ([np.zeros((4, 2), int), np.zeros((5, 3), int)], r"sequence 1 have shape \(5, 3\)"),
    ([np.zeros((4, 2)), np.zeros((5, 2))], "not integer ids"),
    (np.zeros((2, 4)), "got a ndarray"),
])
def test_bad_routes_are_named(routes, message):
    with pytest.raises(ValueError, match=message):
        build_plan([[1, 2, 3, 4], [1, 2, 3, 4, 5]], EVERY_PREFIX, routes=routes)


def test_image_tags_end_a_shared_prefix_and_are_not_route_divergence():
    """Token-identical sequences whose placeholders stand for different images share up to the
    first placeholder; with routes as well, only the routes' own divergence is counted."""
    seqs = [[1, 2, 3, 9, 9, 4, 5], [1, 2, 3, 9, 9, 4, 6]]
    images = [torch.zeros(7, 2, dtype=torch.int64) for _ in seqs]
    for r, image in enumerate(images):
        image[3:5, 0], image[3:5, 1] = r + 1, torch.arange(1, 3)  # image r, tokens 1 and 2
    assert build_plan(seqs, EVERY_PREFIX).prefix_lens == (0, 6)
    plan = build_plan(seqs, EVERY_PREFIX, images=images)
    assert plan.prefix_lens == (0, 3)
    assert plan.route_divergent_prefix_tokens == 0
    routes = routes_of(seqs)
    routes[1][1, 1, 0] += 1
    with_routes = build_plan(seqs, EVERY_PREFIX, routes=routes, images=images)
    assert with_routes.prefix_lens == (0, 1)
    assert with_routes.route_divergent_prefix_tokens == 2
    with pytest.raises(ValueError, match="images of sequence 1 have shape"):
        build_plan(seqs, EVERY_PREFIX, images=[images[0], images[1][:3]])
