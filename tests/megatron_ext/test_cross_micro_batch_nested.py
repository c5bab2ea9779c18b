"""Nested cross-micro-batch schedules - a prefix longer than the budget, a two-level tree: exact.

The same agent group as ``test_cross_micro_batch`` (a 113-token common prefix, 9 episodes,
1452 tokens, 444 unique) under a budget of 35: the prefix in 4 chunks, each reading the ones
before, the branches below it that do not fit 35 tokens as sub-trees reading all 4, the
suffixes reading their stacks (kept and recomputed). A two-level tree (a 49-token
prefix, three first-turn branches of 3 episodes each that do not fit one micro-batch of 90)
gets a shared block per branch. Judged as ``verify`` judges (float64 verdict against the plain
run of the same samples in the same micro-batches) and within 1e-5 of the plain fp32 run;
every prefix computed once. A control that drops the first chunk's accumulated dK/dV fails
on the gradients. MoE router statistics on a chunked prompt; TP=2 with sequence parallelism
on the chunked prefix.
"""

from __future__ import annotations

import pytest
import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.equivalence import max_rel_diff, within_tolerance
from prefix_sharing.workloads import make_workload

from ._distributed import PRESET, run_distributed, tiny_gpt
from ._router_statistics import reset_router_statistics, router_statistics, routers
from .test_cross_micro_batch import (_LOSSES, MOE, MOE_VARIANTS, _group, _split_runs,
                                     assert_exact, assert_router_statistics_equal)

CONFIG = PrefixSharingConfig(min_prefix_len=1, backend="torch")
CHUNKED = 35  # the 113-token prefix: 4 chunks
TREE = dict(num_tasks=1, num_turns=3, branching=3, system_len=40, task_len=(8, 9),
            turn_len=(20, 24), seed=3)
TREE_BUDGET = 90
HEAD_DIM = PRESET.hidden_size // PRESET.num_attention_heads


def _kv_bytes(preset, rows: int, tp: int = 1) -> int:
    """K and V, leaves and gradients, fp32: 2 x 2 x layers x rows x K/V heads x head dim."""
    head_dim = preset.hidden_size // preset.num_attention_heads
    return 2 * 2 * preset.num_layers * rows * preset.num_query_groups // tp * head_dim * 4


def _judged(cross, build, seqs) -> dict:
    from prefix_sharing.engines.megatron import compare

    (plain, plain_statistics), (reference, _) = _split_runs(build, seqs, cross)
    return {"plain_statistics": plain_statistics,
            "vs_reference": compare(cross.run, reference), "plain": compare(plain, reference),
            "vs_plain": compare(cross.run, plain), "figures": cross.report(),
            "held_rows": [s.held_rows for s in cross.schedules],
            "blocks": [[(b.length, b.reads, b.node) for b in s.blocks] for s in cross.schedules]}


def _job(rank: int) -> dict:
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross

    report = {}
    seqs = _group()
    model = tiny_gpt("shared")
    for name, recompute in (("kept", False), ("recomputed", True)):
        cross = forward_backward_cross(model, seqs, CHUNKED, CONFIG, recompute_prefix=recompute)
        report[name] = _judged(cross, tiny_gpt, seqs)
    report["dropped_chunk"] = _dropped_first_chunk(model, seqs)
    tree = make_workload("agent", vocab_size=PRESET.vocab_size, **TREE).sequences
    report["tree"] = _judged(forward_backward_cross(model, tree, TREE_BUDGET, CONFIG),
                             tiny_gpt, tree)
    return report


def _dropped_first_chunk(model, seqs) -> dict:
    """The control: the first chunk's backward runs without the dK/dV its readers (the later
    chunks and every suffix) accumulated in its leaves (its own loss still reaches it)."""
    from prefix_sharing.cross_micro_batch import plan_group
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.prefix_kv import PrefixKV

    term, calls = PrefixKV.gradient_term, []
    blocks = len(plan_group(seqs, CHUNKED, CONFIG).blocks)

    def skipping_the_last(self):  # blocks close in reverse: chunk 0 last
        calls.append(self)
        return term(self) * (len(calls) < blocks)

    PrefixKV.gradient_term = skipping_the_last
    try:
        cross = forward_backward_cross(model, seqs, CHUNKED, CONFIG)
    finally:
        PrefixKV.gradient_term = term
    return _judged(cross, tiny_gpt, seqs)


@pytest.fixture(scope="module")
def report() -> dict:
    return run_distributed(_job, 1, timeout=900)[0]


@pytest.mark.parametrize("mode", ["kept", "recomputed"])
def test_a_prefix_of_four_budgets_in_chunks_equals_the_plain_batch(report, mode):
    run = report[mode]
    assert_exact(run)
    figures = run["figures"]
    (blocks,) = run["blocks"]
    chunks = [(reads, node) for _, reads, node in blocks[:4]]
    assert chunks == [((), 0), ((0,), 0), ((0, 1), 0), ((0, 1, 2), 0)]
    assert sum(n for n, _, _ in blocks[:4]) == figures["prefix_lens"][0] == 113
    # the branches under it that do not fit 35 tokens: sub-trees reading all 4 chunks
    assert all(node > 0 and reads[:4] == (0, 1, 2, 3) for _, reads, node in blocks[4:])
    assert figures["max_tokens_computed"] <= CHUNKED
    recomputed = sum(n for n, _, _ in blocks) if mode == "recomputed" else 0  # each block again
    assert figures["tokens_unique"] == 444
    assert figures["tokens_computed"] == 444 + recomputed
    assert figures["recomputed_tokens"] == recomputed
    # the deepest stack's leaves and gradients (every chunk's, and a sub-tree's)
    (rows,) = run["held_rows"]
    assert rows > 113 and figures["held_bytes"] == _kv_bytes(PRESET, rows)


def test_a_two_level_tree_computes_every_prefix_once(report):
    run = report["tree"]
    assert_exact(run)
    (blocks,) = run["blocks"]
    assert len({node for _, _, node in blocks}) == 4  # the prefix, then one per branch
    assert all(reads == (0,) for _, reads, node in blocks if node)  # each reads the prefix
    figures = run["figures"]
    assert figures["tokens_computed"] == figures["tokens_unique"]
    assert figures["recomputed_tokens"] == 0
    assert figures["held_bytes"] == _kv_bytes(PRESET, run["held_rows"][0])


def test_a_control_that_drops_the_first_chunks_read_through_gradient_fails(report):
    run = report["dropped_chunk"]
    verdict = within_tolerance(run["vs_reference"], run["plain"], torch.float32)
    assert not verdict["grads"]
    assert verdict["log_probs"] and verdict["loss"]  # the forward is untouched


def _moe_job(rank: int) -> dict:
    """One GRPO group (a 41-token prompt, 6 responses) under a budget of 25: the prompt in two
    chunks; the router statistics of the plain micro-batches."""
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross
    from prefix_sharing.engines.megatron import gpt_model

    w = make_workload("grpo", num_prompts=1, group_size=6, prompt_len=(40, 41),
                      response_len=(12, 24), vocab_size=MOE.vocab_size, seed=5)
    report = {}
    for variant in ("losses", "expert_bias"):
        def build(layout: str, settings=MOE_VARIANTS[variant], **overrides) -> torch.nn.Module:
            return gpt_model(MOE, layout=layout, **settings, **overrides)

        ours = build("shared")
        reset_router_statistics(ours)
        cross = forward_backward_cross(ours, w.sequences, 25, CONFIG)
        stats = router_statistics(ours)
        run = _judged(cross, build, w.sequences)
        plain_stats = run.pop("plain_statistics")
        run.update(statistics={k: max_rel_diff(v, plain_stats[k]) for k, v in stats.items()},
                   statistic_names=sorted(plain_stats), routers=len(routers(ours)))
        report[variant] = run
    return report


@pytest.fixture(scope="module")
def moe_report() -> dict:
    return run_distributed(_moe_job, 1, timeout=900)[0]


@pytest.mark.parametrize("variant", ["losses", "expert_bias"])
def test_moe_statistics_with_a_chunked_prompt(moe_report, variant):
    run = moe_report[variant]
    assert_exact(run)
    assert_router_statistics_equal(run)
    expected = _LOSSES | ({"layer0.tokens_per_expert"} if variant == "expert_bias" else set())
    assert expected <= set(run["statistic_names"])
    (blocks,) = run["blocks"]
    assert [reads for _, reads, node in blocks if node == 0] == [(), (0,)]  # two chunks
    figures = run["figures"]
    assert figures["tokens_computed"] == figures["tokens_unique"]
    # K/V and router logits (experts per layer), leaves and gradients, of both chunks
    (rows,) = run["held_rows"]
    assert figures["held_bytes"] == _kv_bytes(MOE, rows) + 2 * run["routers"] * rows * 8 * 4


def _tp2_job(rank: int) -> dict:
    from prefix_sharing.engines.cross_micro_batch import forward_backward_cross

    def build(layout: str, **overrides) -> torch.nn.Module:
        return tiny_gpt(layout, sequence_parallel=True, **overrides)

    seqs = _group()
    cross = forward_backward_cross(build("shared"), seqs, CHUNKED, CONFIG)
    run = _judged(cross, build, seqs)
    run["rows"] = [p.input_ids.numel() for s in cross.schedules
                   for p in [b.plan for b in s.blocks] + [m.plan for m in s.suffixes]]
    return run


def test_tensor_parallel_2_with_sequence_parallelism_on_a_chunked_prefix():
    """Each rank keeps its own K/V heads of every chunk; every micro-batch (chunks included)
    is padded to 2 rows and split over the ranks; a chunk's pad rows are not kept."""
    for run in run_distributed(_tp2_job, 2, tp=2, timeout=900):
        assert_exact(run)
        assert all(rows % 2 == 0 for rows in run["rows"]), run["rows"]
        assert [reads for _, reads, _ in run["blocks"][0][:4]] == [(), (0,), (0, 1), (0, 1, 2)]
        assert run["figures"]["tokens_computed"] == run["figures"]["tokens_unique"]
        assert run["figures"]["held_bytes"] == _kv_bytes(PRESET, run["held_rows"][0], tp=2)
