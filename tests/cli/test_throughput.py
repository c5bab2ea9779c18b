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
from prefix_sharing.flops import count_flops
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


def test_cross_view_reports_a_long_history_against_the_whole_group(capfd):
    """``history``: a 512-token history and 8 branches of 32 under a 200-token budget. The
    ordinary split runs every sequence alone, its history in each; ``cross`` computes the
    history once in chunks, as ``whole`` (the group as one micro-batch) does. Figures only."""
    code, out, _ = bench(capfd, "--workload", "history", "--token-budget", 200,
                         "--cross-micro-batch", "--json")
    assert code == 0
    (result,) = json.loads(out)["results"]
    preset = get_preset("tiny")
    w = make_workload("history", vocab_size=preset.vocab_size, **BENCH_SIZES["history"])
    whole_plan = build_plan(w.sequences, PrefixSharingConfig())
    assert whole_plan.num_tokens_unique == 512 + 8 * 32
    whole, plain, shared, cross = (result[m] for m in ("whole", "plain", "shared", "cross"))
    assert whole["tokens_computed"] == whole["max_tokens_computed"] == 512 + 8 * 32
    assert whole["flops"] == count_flops(whole_plan, preset).shared
    for split in (plain, shared):  # each 544-token sequence alone, over the budget
        assert split["oversized"] == 8 and split["micro_batches"] == 8
        assert split["tokens_computed"] == 8 * 544 and split["max_tokens_computed"] == 544
        assert split["vs_whole"]["tokens"] == 8 * 544 / (512 + 8 * 32)
    assert plain["flops"] == shared["flops"] == sum(
        count_flops(build_plan([s], PrefixSharingConfig()), preset).shared for s in w.sequences)
    assert cross["tokens_computed"] == whole["tokens_computed"]  # the history once
    assert cross["max_tokens_computed"] <= 200 and cross["num_shared_blocks"] == 3
    assert cross["vs_whole"]["tokens"] == 1.0 and cross["vs_whole"]["flops"] == pytest.approx(1.0)
    head_dim = preset.hidden_size // preset.num_attention_heads
    assert cross["held_bytes"] == 2 * 2 * preset.num_layers * 512 * preset.num_query_groups \
        * head_dim * 4
    # K/V rows one attention layer holds: cross's micro-batches their own rows, the stored
    # history read in place (held_bytes); gathered, a suffix would hold it twice more
    assert whole["kv_rows_per_layer"] == 512 + 8 * 32 and plain["kv_rows_per_layer"] == 544
    assert "sources" in cross["kv_execution"] and "gather" not in cross["kv_execution"]
    assert cross["kv_rows_per_layer"] <= 200 < 2 * 512 < cross["kv_rows_gather"]
    for mode in (whole, plain, shared, cross):
        assert mode["peak_mb"] > 0 and mode["vs_whole"]["peak"] == mode["peak_mb"] / whole["peak_mb"]
        assert mode["vs_whole"]["time"] == mode["batch_ms"] / whole["batch_ms"]
    code, out, _ = bench(capfd, "--workload", "history", "--token-budget", 200,
                         "--cross-micro-batch")
    second = out.split("\n\n")[2].splitlines()
    assert second[0].split()[:3] == ["workload", "mode", "tokens"]
    assert [line.split()[1] for line in second[1:5]] == ["whole", "plain", "shared", "cross"]
