"""The tiny HF models the tests run: a plain one and its sharing twin on the same weights."""

from __future__ import annotations

import copy

import torch

from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
from prefix_sharing.presets import PRESETS, sharp

PRESET = sharp(PRESETS["tiny"])  # 2 layers, hidden 64, 4 query heads over 2 K/V heads, vocab 512


def plain_and_shared(family: str = "llama", attn_implementation: str = "sdpa",
                     dtype: torch.dtype = torch.float32, **overrides) -> tuple:
    """``(plain, shared)``: the same seeded weights, the shared one on the sharing attention."""
    plain = build_model(family, PRESET, attn_implementation=attn_implementation, dtype=dtype,
                        **overrides)
    return plain, enable_prefix_sharing(copy.deepcopy(plain))
