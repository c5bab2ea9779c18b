"""Tiny vision-language batches: token sequences with image placeholder runs and their images
in verl's per-sample layout (``pixel_values``, ``image_grid_thw``)."""

from __future__ import annotations

import copy
import dataclasses

import torch

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.equivalence import advantages, compare_runs
from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
from prefix_sharing.fsdp_compat.runs import plain_vlm_run, shared_run

from ._models import EVERY_PREFIX, PRESET

# 4 layers: Qwen3.5 holds Gated DeltaNet and attention layers, Qwen3-VL's deepstack 2 of them
VLM_PRESET = dataclasses.replace(PRESET, num_layers=4, full_attention_every=2)
TEXT_VOCAB = VLM_PRESET.vocab_size - 4  # the last four ids are the vision specials
PATCH = 3 * 2 * 2 * 2  # channels x temporal x patch x patch


def vlm_models(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(plain, shared)`` float64 twins (eager attention, eager experts)."""
    plain = build_model(family, VLM_PRESET, attn_implementation="eager", dtype=torch.float64)
    if hasattr(plain, "set_experts_implementation"):
        plain.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return plain, enable_prefix_sharing(copy.deepcopy(plain))


def random_image(gen: torch.Generator, h: int, w: int, dtype: torch.dtype) -> dict:
    """One image of ``h x w`` patches in verl's per-sample layout, drawn from ``gen``."""
    return {"pixel_values": torch.randn(h * w, PATCH, generator=gen, dtype=dtype),
            "image_grid_thw": torch.tensor([[1, h, w]])}


def placeholder_ids(config, image: dict) -> torch.Tensor:
    """The tokens standing for ``image``: vision start, one placeholder per merged 2x2 patch
    block, vision end."""
    n = int(image["image_grid_thw"].prod()) // 4
    return torch.tensor([config.vision_start_token_id] + [config.image_token_id] * n
                        + [config.vision_end_token_id])


class Batch:
    """Builds sequences and their multi_modal_inputs from a seeded generator."""

    def __init__(self, config, seed: int = 0) -> None:
        self.config, self.gen = config, torch.Generator().manual_seed(seed)
        self.sequences: list[torch.Tensor] = []
        self.mm: list[dict | None] = []

    def text(self, n: int) -> torch.Tensor:
        return torch.randint(0, TEXT_VOCAB, (n,), generator=self.gen)

    def image(self, h: int = 4, w: int = 4) -> dict:
        """One image of ``h x w`` patches (``h * w / 4`` placeholder tokens)."""
        return random_image(self.gen, h, w, torch.float64)

    def placeholders(self, image: dict) -> torch.Tensor:
        return placeholder_ids(self.config, image)

    def add(self, parts: list[torch.Tensor], images: list[dict]) -> None:
        self.sequences.append(torch.cat(parts))
        self.mm.append({"pixel_values": torch.cat([i["pixel_values"] for i in images]),
                        "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images])}
                       if images else None)


def compare(plain, shared, batch: Batch, config: PrefixSharingConfig = EVERY_PREFIX,
            shared_mm: list | None = None):
    """The shared run (on ``shared_mm`` when given, else the batch's images) against
    transformers' model sequence by sequence on the batch's images."""
    weights = advantages(sum(s.numel() for s in batch.sequences), seed=0)
    mm = batch.mm if shared_mm is None else shared_mm
    return compare_runs(shared_run(shared, batch.sequences, weights, config,
                                   multi_modal_inputs=mm),
                        plain_vlm_run(plain, batch.sequences, weights, batch.mm))
