"""prefix-sharing analyze on a vision-language dump: ``image_hashes`` name the images behind the
placeholder runs, images enter the tokens' identity, and the report counts vision tokens and
images; the hashes are the sharing forward's own image identity."""

import pytest
import torch

from prefix_sharing.fsdp_compat import hf_config
from prefix_sharing.fsdp_compat.vision import hashed_image_tags, image_hashes, vision_batch
from prefix_sharing.fsdp_compat.vlm import MIN_TRANSFORMERS
from prefix_sharing.presets import get_preset

from .test_analyze import analyze, analyze_json, write_jsonl

IMAGE = 99  # the placeholder id of these files
# 4 text tokens, an image of 4 placeholder tokens, 2 text tokens
PROMPT = [1, 2, 3, 4] + [IMAGE] * 4 + [5, 6]


def grpo_rows(hashes):
    """One group of 3 responses (3 tokens each, distinct first tokens) per hash, every group
    on the same prompt tokens: only its hash tells the groups' images apart."""
    return [{"uid": f"u{g}", "prompt_ids": PROMPT, "response_ids": [10 + 3 * g + k, 30, 31],
             "image_hashes": [h]} for g, h in enumerate(hashes) for k in range(3)]


def test_token_identical_prompts_over_different_images_are_not_shared(capsys, tmp_path):
    """Two groups, images a and b: they share the 4 text tokens before the image only; each
    group shares its own image. Control: one image under both groups shares the whole prompt."""
    path = write_jsonl(tmp_path / "mm.jsonl", grpo_rows(["a", "b"]))
    report = analyze_json(capsys, path, "--image-token-id", IMAGE, "--min-prefix-len", 1)
    assert report["tokens_total"] == 6 * 13
    assert report["tokens_unique"] == 4 + 2 * (4 + 2) + 6 * 3
    assert report["structure"]["longest_shared_prefix"] == len(PROMPT)
    assert (report["vision_tokens_total"], report["vision_tokens_computed"]) == (24, 8)
    assert (report["vision_images_total"], report["vision_images_computed"]) == (6, 2)

    same = write_jsonl(tmp_path / "same.jsonl", grpo_rows(["a", "a"]))
    control = analyze_json(capsys, same, "--image-token-id", IMAGE, "--min-prefix-len", 1)
    assert control["tokens_unique"] == len(PROMPT) + 6 * 3
    assert (control["vision_tokens_total"], control["vision_tokens_computed"]) == (24, 4)
    assert (control["vision_images_total"], control["vision_images_computed"]) == (6, 1)


def test_text_report_and_parquet_give_the_vision_counts(capsys, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = grpo_rows(["a", "b"])
    rows[0].pop("image_hashes")  # a text-only row beside image rows: its own prompt then
    rows[0].update(uid="t", prompt_ids=[1, 2, 3, 4, 7, 7, 7, 7, 5, 6])
    path = write_jsonl(tmp_path / "mm.jsonl", rows)
    code, out, _ = analyze(capsys, path, "--image-token-id", IMAGE)
    assert code == 0
    assert "vision tokens" in out and "computed of 20 image placeholder tokens" in out
    assert "distinct (encoded once each) of 5" in out
    table = pa.table({k: [r.get(k) for r in rows] for k in rows[1]})
    pq.write_table(table, tmp_path / "mm.parquet")
    from_parquet = analyze_json(capsys, tmp_path / "mm.parquet", "--image-token-id", IMAGE)
    from_jsonl = analyze_json(capsys, path, "--image-token-id", IMAGE)
    for report in (from_parquet, from_jsonl):
        report.pop("file"), report.pop("planner_ms")
    assert from_parquet == from_jsonl
    assert from_jsonl["vision_images_total"] == 5


BAD = [
    ([{"input_ids": PROMPT + [IMAGE, 8], "image_hashes": ["a"]}], [],
     "has image_hashes (a vision-language dump), which only analyze reads, given the "
     "placeholder id: --image-token-id N"),
    ([{"input_ids": PROMPT + [8, IMAGE, IMAGE], "image_hashes": ["a"]}], ["--image-token-id", IMAGE],
     "line 1: 1 image hashes but 2 runs of image placeholder tokens (id 99); one hash per run"),
    ([{"input_ids": PROMPT}], ["--image-token-id", IMAGE],
     "line 1: 0 image hashes but 1 runs of image placeholder tokens"),
    ([{"input_ids": PROMPT, "image_hashes": ["a"]}, {"input_ids": [IMAGE] * 2, "image_hashes": ["a"]}],
     ["--image-token-id", IMAGE],
     "line 2: image a has 2 placeholder tokens here but 4 before; one image has one token count"),
    ([{"input_ids": PROMPT, "image_hashes": [7]}], ["--image-token-id", IMAGE],
     "line 1: image_hashes must be a list of image hashes (non-empty strings)"),
    ([{"input_ids": PROMPT}], ["--image-token-id", -1], "--image-token-id must be a token id >= 0"),
]


@pytest.mark.parametrize("rows, options, message", BAD)
def test_bad_image_input_is_one_error_line(capsys, tmp_path, rows, options, message):
    code, out, err = analyze(capsys, write_jsonl(tmp_path / "r.jsonl", rows), *options)
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("prefix-sharing analyze: error: ")
    assert message in err


def test_bench_and_verify_refuse_a_dump_with_images(capsys, tmp_path):
    from prefix_sharing.cli import main

    path = write_jsonl(tmp_path / "mm.jsonl", grpo_rows(["a"]))
    assert main(["bench", "--sequences", path, "--repeats", "1"]) != 0
    assert "only analyze reads" in capsys.readouterr().err


# --------------------------------------------------------------------------- the hash helper
def _image(seed: int, h: int = 4, w: int = 4) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(h * w, 24, generator=gen),
            "image_grid_thw": torch.tensor([[1, h, w]])}


def _sample(*images: dict) -> dict:
    return {key: torch.cat([i[key] for i in images]) for key in ("pixel_values", "image_grid_thw")}


def test_image_hashes_name_each_image_of_a_sample_by_its_content():
    a, b = _image(0), _image(1)
    hashes = image_hashes(_sample(a, b, a))
    assert hashes[0] == hashes[2] != hashes[1] and len(hashes[0]) == 32
    assert image_hashes(_sample(b)) == [hashes[1]]
    assert image_hashes(None) == []
    other_grid = {"pixel_values": a["pixel_values"], "image_grid_thw": torch.tensor([[1, 2, 8]])}
    assert image_hashes(other_grid) != [hashes[0]]  # the grid is part of the identity


def test_tags_from_the_hashes_are_the_sharing_forwards_tags():
    """A dump written with image_hashes plans exactly as the forward plans the images."""
    import transformers

    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
        pytest.skip(f"vision-language configs need transformers >= {MIN_TRANSFORMERS}")
    config = hf_config("qwen2_5_vl", get_preset("tiny"))
    a, b = _image(0), _image(1, 4, 8)

    def run(image: dict) -> list[int]:
        n = int(image["image_grid_thw"].prod()) // 4
        return [config.vision_start_token_id] + [config.image_token_id] * n + [
            config.vision_end_token_id]

    samples = [([5, 6] + run(a) + [7], [a]), ([5] + run(b) + run(a), [b, a]), ([8, 9], [])]
    sequences = [torch.tensor(s) for s, _ in samples]
    mm = [_sample(*images) if images else None for _, images in samples]
    forward = vision_batch(config, sequences, mm)
    dump = hashed_image_tags(sequences, config.image_token_id, [image_hashes(m) for m in mm])
    assert all(torch.equal(x, y) for x, y in zip(dump.tags, forward.tags))
    assert (dump.images_total, dump.images_distinct) == (forward.images_total,
                                                         forward.images_computed) == (3, 2)


def test_the_recorded_vlm_dump_figures_are_what_analyze_gives_on_the_generated_dump(
        capsys, tmp_path):
    """docs/results/vlm_analyze_grpo.json: the dump script and analyze reproduce its counts."""
    import json
    from pathlib import Path

    from tests.script_modules import load_script

    dump = load_script("vlm_grpo_dump")
    path = write_jsonl(tmp_path / "vlm.jsonl", dump.rows())
    report = analyze_json(capsys, path, "--image-token-id", dump.IMAGE)
    recorded = json.loads((Path(__file__).parents[2] / "docs/results/vlm_analyze_grpo.json")
                          .read_text())["payload"]
    keys = ("tokens_total", "tokens_unique", "token_ratio", "structure", "vision_tokens_total",
            "vision_tokens_computed", "vision_images_total", "vision_images_computed")
    assert {k: report[k] for k in keys} == {k: recorded[k] for k in keys}
    groups = dump.PROMPTS
    assert (report["vision_images_total"], report["vision_images_computed"]) == (
        groups * dump.RESPONSES, groups)
    assert report["vision_tokens_computed"] == groups * 256
