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
    ("--workload", "tree", "--model", "tiny-qwen2.5-vl"),  # Qwen2.5-VL, text-only batch
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


def test_bench_a_vision_language_preset_puts_an_image_in_every_prompt(capfd, monkeypatch):
    """tiny-qwen2.5-vl (its image shrunk to 4 x 4 patches for speed): every GRPO prompt holds an
    image, each group's shared and encoded once; the table prints the counts."""
    import dataclasses

    from prefix_sharing.engines.hf import IMAGE_AFTER
    from prefix_sharing.presets import PRESETS

    preset = dataclasses.replace(PRESETS["tiny-qwen2.5-vl"], image_grid=(1, 4, 4))
    monkeypatch.setitem(PRESETS, "tiny-qwen2.5-vl", preset)
    code, out, _ = run(capfd, "bench", "--engine", "hf", "--model", "tiny-qwen2.5-vl",
                       "--repeats", "1", "--workload", "grpo", "--json")
    assert code == 0
    (grpo,) = json.loads(out)["results"]
    sizes = BENCH_SIZES["grpo"]
    w = make_workload("grpo", vocab_size=preset.text_vocab_size, **sizes)
    images = sizes["num_prompts"] * sizes["group_size"]
    assert grpo["vision"] == {"vision_images_total": images,
                              "vision_images_computed": sizes["num_prompts"],
                              "vision_tokens_total": images * 4,
                              "vision_tokens_computed": sizes["num_prompts"] * 4}
    run_len = 4 + 2  # placeholders, vision start and end
    assert grpo["tokens_total"] == w.num_tokens + images * run_len
    prompt_tokens = sum(g.prompt_len + run_len for g in w.groups)
    assert grpo["prompt_only"]["tokens_unique"] == grpo["tokens_total"] - sum(
        (len(g.members) - 1) * (g.prompt_len + run_len) for g in w.groups)
    assert prompt_tokens > IMAGE_AFTER and "peers" not in grpo  # PrefixGrouper: text only
    code, out, _ = run(capfd, "bench", "--engine", "hf", "--model", "tiny-qwen2.5-vl",
                       "--repeats", "1", "--workload", "none")
    assert code == 0 and "none       vision: 8 of 8 images encoded, 32 of 32 vision tokens" in out


@pytest.mark.parametrize("argv, key", [
    (("--engine", "megatron"), "cli.vlm_preset"),
    (("--engine", "hf", "--sequences", "{path}"), "cli.vlm_preset_sequences")])
def test_a_vision_language_preset_is_refused_by_name(capfd, tmp_path, argv, key):
    from prefix_sharing.refusals import REFUSALS

    path = tmp_path / "r.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n')
    code, out, err = run(capfd, "bench", "--model", "tiny-qwen2.5-vl", "--repeats", "1",
                         *(a.format(path=path) for a in argv))
    assert code != 0 and out == "" and len(err.strip().splitlines()) == 1
    assert REFUSALS[key].setting in err
