"""prefix-sharing verify / bench --engine hf: the HuggingFace engine behind the same commands.

Timings are smoke values (tiny model, one repeat): the tests pin the report's structure, the
verdicts and the token counts, never a speed.
"""

import json

import pytest

from prefix_sharing.cli import main
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.fsdp_compat.prefix_grouper_peer import grouped_batch
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import make_workload


def run(capfd, *argv):
    code = main([*map(str, argv)])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [
    ("--workload", "tree"),
    ("--workload", "grpo", "--mode", "prompt_only", "--dtype", "bfloat16", "--steps", "2"),
    ("--workload", "agent", "--model", "tiny-moe"),
    ("--workload", "tree", "--model", "tiny-hybrid"),  # Qwen3.5: 3 Gated DeltaNet : 1 attention
    ("--workload", "tree", "--model", "tiny-nemotron-h"),  # Mamba-2, MLP, attention, MoE
])
def test_verify_passes_on_the_hf_engine(capfd, argv):
    code, out, _ = run(capfd, "verify", "--engine", "hf", "--json", *argv)
    report = json.loads(out)
    assert code == 0 and report["passed"], report
    assert report["engine"] == "hf"
    assert report["tokens_unique"] < report["tokens_total"]


def test_verify_refuses_model_parallel_layouts_in_one_line(capfd):
    code, out, err = run(capfd, "verify", "--engine", "hf", "--tp", "2")
    assert code != 0 and out == ""
    assert "data-parallel (FSDP) only" in err and len(err.strip().splitlines()) == 1


def test_bench_reports_prefix_grouper_beside_ours(capfd):
    code, out, _ = run(capfd, "bench", "--engine", "hf", "--model", "tiny", "--repeats", "1",
                       "--workload", "grpo", "--json")
    assert code == 0
    (grpo,) = json.loads(out)["results"]
    peer = grpo["peers"]["prefix_grouper"]
    assert {"tokens_computed", "ms", "steps_ms", "peak_mb", "speedup", "memory_ratio"} <= set(peer)
    w = make_workload("grpo", vocab_size=get_preset("tiny").vocab_size, **BENCH_SIZES["grpo"])
    # PrefixGrouper runs its padded grid; prompt-only sharing computes the same real tokens
    grid = grouped_batch(w.sequences, w.groups)
    assert peer["tokens_computed"] == grid.input_ids.numel()
    assert grpo["prompt_only"]["tokens_unique"] == int(grid.grouper.total_lens.sum())
    assert peer["peak_mb"] > 0 and len(peer["steps_ms"]) == 1


def test_bench_table_has_a_prefix_grouper_row(capfd):
    code, out, _ = run(capfd, "bench", "--engine", "hf", "--model", "tiny", "--repeats", "1",
                       "--workload", "tree")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("tree")]
    assert [r[1] for r in rows] == ["arbitrary", "prompt_only", "PG"]


def test_the_megatron_engine_refuses_the_mamba_hybrid_preset_in_one_line(capfd):
    code, out, err = run(capfd, "verify", "--model", "tiny-nemotron-h", "--workload", "tree")
    assert code == 2 and out == ""
    assert "tiny-nemotron-h preset has Mamba-2 layers" in err and "--engine hf" in err
    assert len(err.strip().splitlines()) == 1


def test_an_mla_preset_is_refused_on_the_hf_engine_in_one_line(capfd):
    code, _, err = run(capfd, "verify", "--engine", "hf", "--model", "tiny-mla",
                       "--workload", "tree")
    assert code == 2 and "tiny-mla preset (multi-latent attention) runs on the megatron" in err
