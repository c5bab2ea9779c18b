"""scripts/bench_kv_sources.py --context-parallel: the rows it reports are the plan's, counted
here from the CP slices' own key ranges."""

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.workloads import make_workload
from tests.script_modules import load_script


def test_context_parallel_rows_are_the_flat_rows_over_sources_and_more_under_the_gather():
    script = load_script("bench_kv_sources")
    for name in script.WORKLOADS:
        plan = build_plan(make_workload(name, **BENCH_SIZES[name]).sequences,
                          PrefixSharingConfig(), pad_to_multiple_of=2)
        row = script.context_parallel_rows(name, 1, 2)
        half = plan.num_tokens_flat // 2
        # the second rank's pieces: each segment cut at the slice, over its keys up to there
        q, kv = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
        keys = [sum(kv[i + 1] - kv[i] - (q[i + 1] - q[i]) + min(q[i + 1], hi) - q[i]
                    for i in range(len(q) - 1) if min(q[i + 1], hi) > max(q[i], lo))
                for lo, hi in ((0, half), (half, 2 * half))]
        assert row["kv_rows_sources"] == plan.num_tokens_flat
        assert row["kv_rows_gather"] == plan.num_tokens_flat + max(keys)
        assert (row["query_rows_copied"] > 0) == plan.has_kv_gather


def test_a_windowed_layer_holds_the_computed_rows_over_sources_and_the_trimmed_gather_before():
    """``--window``: the gather it compares against is trimmed to each segment's window (a
    tail of ``s`` queries over ``L`` keys keeps ``min(L, s + window - 1)``)."""
    script = load_script("bench_kv_sources")
    row = script.measure("grpo", 1, 1, window=16)
    plan = build_plan(make_workload("grpo", **BENCH_SIZES["grpo"]).sequences,
                      PrefixSharingConfig())
    q, kv = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
    reach = sum(min(kv[i + 1] - kv[i], q[i + 1] - q[i] + 15) for i in range(len(q) - 1))
    assert (row["execution"], row["kv_rows_after"]) == ("sources", plan.num_tokens_flat)
    assert row["kv_rows_gather"] == plan.num_tokens_flat + reach
