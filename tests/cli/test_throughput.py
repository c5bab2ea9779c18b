"""prefix-sharing bench --token-budget: the throughput view's report, its counts and its errors.

Timings are smoke values (tiny model, one repeat): the tests pin the split each mode used and
the report's arithmetic, never a speed.
"""

import json

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.batching import split_micro_batches
from prefix_sharing.cli import main
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import make_workload

BUDGET = 640


def bench(capfd, *argv):
    code = main(["bench", "--model", "tiny", "--repeats", "1", *map(str, argv)])
    out, err = capfd.readouterr()
    return code, out, err


def test_json_report_counts_the_micro_batches_of_each_budget(capfd):
    code, out, _ = bench(capfd, "--workload", "grpo", "--workload", "tree",
                         "--token-budget", BUDGET, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["token_budget"] == BUDGET
    for result in report["results"]:
        w = make_workload(result["workload"], vocab_size=get_preset("tiny").vocab_size,
                          **BENCH_SIZES[result["workload"]])
        plain = split_micro_batches(w.sequences, BUDGET, PrefixSharingConfig(mode="off"))
        shared = split_micro_batches(w.sequences, BUDGET, PrefixSharingConfig())
        for mode, split in (("plain", plain), ("shared", shared)):
            entry = result[mode]
            assert entry["micro_batches"] == len(split.micro_batches)
            assert entry["sequences_per_micro_batch"] == len(w.sequences) / len(split.micro_batches)
            assert entry["max_tokens_computed"] == max(split.tokens_computed) <= BUDGET
            assert len(entry["batch_steps_ms"]) == 1
            assert entry["sequences_per_s"] == pytest.approx(
                len(w.sequences) / entry["batch_ms"] * 1e3)
        assert result["plain"]["token_ratio"] == 1.0 and result["shared"]["token_ratio"] > 1.5
        assert result["shared"]["micro_batches"] < result["plain"]["micro_batches"]
        assert result["throughput_ratio"] == pytest.approx(
            result["shared"]["sequences_per_s"] / result["plain"]["sequences_per_s"])


def test_text_table(capfd):
    code, out, _ = bench(capfd, "--workload", "steprl", "--token-budget", BUDGET)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["workload", "budget", "mode", "micro-b"]
    assert [line.split()[2] for line in lines[1:3]] == ["plain", "shared"]


@pytest.mark.parametrize("argv, message", [
    (["--token-budget", "0"], "--token-budget must be at least 1"),
    (["--workload", "grpo", "--token-budget", "100"], "below the longest sequence of workload 'grpo'"),
    (["--token-budget", "640", "--plot", "x.png"], "--plot draws the step bench"),
])
def test_bad_budget_is_one_line_on_stderr(capfd, argv, message):
    code, out, err = bench(capfd, *argv)
    assert code != 0 and out == ""
    assert err.startswith("prefix-sharing bench: error:") and message in err
    assert len(err.strip().splitlines()) == 1


def test_cross_micro_batch_mode_computes_each_prefix_once(capfd):
    """grpo's groups exceed a 300-token budget: ``shared`` cuts them and recomputes their
    prompts, ``cross`` computes each prompt once."""
    code, out, _ = bench(capfd, "--workload", "grpo", "--token-budget", 300,
                         "--cross-micro-batch", "--json")
    assert code == 0
    (result,) = json.loads(out)["results"]
    w = make_workload("grpo", vocab_size=get_preset("tiny").vocab_size, **BENCH_SIZES["grpo"])
    whole = build_plan(w.sequences, PrefixSharingConfig())
    cross, shared = result["cross"], result["shared"]
    assert shared["groups_split"] > 0
    assert cross["groups_split"] == 0 and cross["prefix_recomputes_avoided"] > 0
    assert cross["tokens_unique"] == whole.num_tokens_unique
    assert cross["tokens_computed"] == whole.num_tokens_unique  # each prompt once
    assert cross["max_tokens_computed"] <= 300
    assert cross["micro_batches"] == cross["num_micro_batches"] >= 2 * len(w.groups)
    assert result["cross_throughput_ratio"] == pytest.approx(
        cross["sequences_per_s"] / result["plain"]["sequences_per_s"])


@pytest.mark.parametrize("argv, message", [
    (["--workload", "grpo", "--cross-micro-batch"], "--cross-micro-batch needs --token-budget"),
    (["--workload", "none", "--token-budget", "640", "--cross-micro-batch"],
     "workload 'none': a group needs at least two sequences"),
    (["--workload", "grpo", "--recompute", "full"], "--recompute runs in the throughput view"),
])
def test_cross_micro_batch_refusals_are_one_line(capfd, argv, message):
    code, out, err = bench(capfd, *argv)
    assert code != 0 and out == "" and message in err
    assert len(err.strip().splitlines()) == 1
