"""Writes a multimodal GRPO rollout dump for ``prefix-sharing analyze --image-token-id``: PROMPTS
prompts of RESPONSES responses each, one image per prompt (random pixels of a 32 x 32 patch
grid: 256 vision tokens after Qwen2.5-VL's 2 x 2 merge), Qwen2.5-VL's special ids, and each
image's hash computed from its ``multi_modal_inputs`` as the sharing forward identifies it.

    python scripts/vlm_grpo_dump.py /tmp/vlm_grpo.jsonl
    prefix-sharing analyze /tmp/vlm_grpo.jsonl --image-token-id 151655 --json
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from prefix_sharing.fsdp_compat.vision import image_hashes  # noqa: E402

PROMPTS, RESPONSES = 8, 8
IMAGE, START, END = 151655, 151652, 151653  # Qwen2.5-VL's image pad, vision start / end
GRID = (1, 32, 32)  # 1024 patches -> 256 vision tokens
PATCH = 3 * 2 * 14 * 14  # channels x temporal x patch x patch
TEXT_VOCAB = 151643


def rows(seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def text(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return torch.randint(0, TEXT_VOCAB, (n,), generator=gen).tolist()

    out = []
    for p in range(PROMPTS):
        sample = {"pixel_values": torch.randn(GRID[1] * GRID[2], PATCH, generator=gen),
                  "image_grid_thw": torch.tensor([GRID])}
        vision = [START] + [IMAGE] * (GRID[1] * GRID[2] // 4) + [END]
        prompt = text(16, 32) + vision + text(32, 96)
        hashes = image_hashes(sample)
        out += [{"uid": f"p{p}", "prompt_ids": prompt, "response_ids": text(64, 256),
                 "image_hashes": hashes} for _ in range(RESPONSES)]
    return out


if __name__ == "__main__":
    path = pathlib.Path(sys.argv[1])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {path}: {PROMPTS} prompts x {RESPONSES} responses, one image each")
