"""scripts/window_gather.py: the trimmed gather it reports is what each segment's first query
can reach, counted here segment by segment."""

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.workloads import make_workload
from tests.script_modules import load_script


def test_reported_rows_are_the_keys_each_segment_can_reach():
    rows = {r["workload"]: r for r in load_script("window_gather").measure([16, 128])}
    for name, row in rows.items():
        plan = build_plan(make_workload(name, vocab_size=512, **BENCH_SIZES[name]).sequences,
                          PrefixSharingConfig())
        q, kv = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
        for window in (16, 128):
            # a tail of s queries over L keys reaches back window - 1 keys before its first
            reach = sum(min(kv[i + 1] - kv[i], q[i + 1] - q[i] + window - 1)
                        for i in range(len(q) - 1))
            assert row["gathered_window"][str(window)] == (reach if plan.has_sharing else 0)
        assert row["gathered_window"]["16"] <= row["gathered_window"]["128"] <= row["gathered_full"]
    assert rows["tree"]["gathered_window"]["16"] < rows["tree"]["gathered_full"]
