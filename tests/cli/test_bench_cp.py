"""prefix-sharing bench --cp: plain CP vs shared CP, and the K/V bytes the collectives moved.

The bytes are counted by wrapping megatron's all-gather and reduce-scatter during a step; here
they must equal the formula for each plan (forward gathered = backward scattered =
``kv_bytes_per_layer``), and their ratio the ratio of the flat rows the ranks split. Timings
are smoke values (tiny model, one repeat), never asserted.
"""

import json

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli import main
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.megatron_ext.context_parallel import kv_bytes_per_layer
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import make_workload


def bench(capfd, *argv):
    code = main(["bench", "--model", "tiny", "--repeats", "1", *map(str, argv)])
    out, err = capfd.readouterr()
    return code, out, err


def test_counted_bytes_are_the_formula_and_shrink_with_sharing(capfd):
    code, out, _ = bench(capfd, "--cp", "2", "--workload", "grpo", "--workload", "none",
                         "--backend", "torch", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["cp"], report["tp"], report["pp"], report["length_scale"]) == (2, 1, 1, 1)
    grpo, none = report["results"]
    tiny = get_preset("tiny")  # 2 K/V heads of 16, fp32
    plan = build_plan(make_workload("grpo", vocab_size=tiny.vocab_size,
                                    **BENCH_SIZES["grpo"]).sequences,
                      PrefixSharingConfig(), pad_to_multiple_of=2)
    assert grpo["shared"]["rows"] == plan.num_tokens_flat
    assert grpo["plain"]["rows"] == plan.num_tokens_total + plan.num_tokens_total % 2
    for result in (grpo, none):
        assert result["formula_matches"] and result["layers_on_this_stage"] == tiny.num_layers
        for side in ("plain", "shared"):
            entry = result[side]
            expected = kv_bytes_per_layer(entry["rows"], 2, 2, 16, 4)
            assert entry["gathered_bytes_per_layer"] == expected > 0
            assert entry["scattered_bytes_per_layer"] == expected
            assert entry["ms"] > 0
    assert grpo["bytes_ratio"] == pytest.approx(grpo["plain"]["rows"] / plan.num_tokens_flat)
    assert grpo["bytes_ratio"] > 1.5 and none["bytes_ratio"] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2"], "--tp 2 --pp 1 run in the context-parallel bench; add --cp 2"),
    (["--cp", "2", "--token-budget", "4096"], "leave out --token-budget"),
    (["--cp", "2", "--engine", "hf"], "--cp runs on the megatron engine"),
    (["--cp", "0"], "--tp, --pp and --cp must be at least 1"),
])
def test_bad_input_is_one_line_on_stderr(capfd, argv, message):
    code, out, err = bench(capfd, *argv)
    assert code != 0 and out == ""
    assert err.startswith("prefix-sharing bench: error:") and message in err
    assert len(err.strip().splitlines()) == 1
