"""The demo's last line says what it checked (verify's exactness) and what it only measured."""

from prefix_sharing.cli.demo import verdict


def test_the_verdict_names_what_was_checked_and_that_bench_has_none():
    line = verdict([{"passed": True}, {"passed": True}], ["grpo", "agent"])
    assert line.startswith("verify passed: shared == plain within tolerance on all 2 workloads")
    assert "bench measured times only (no verdict" in line


def test_a_failed_workload_is_named():
    line = verdict([{"passed": True}, {"passed": False}], ["grpo", "agent"])
    assert line.startswith("verify FAILED on agent")
