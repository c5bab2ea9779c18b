"""Test harness: megatron-core ranks in spawned processes, and the tiny test model.

Every run, even with one rank, happens in freshly spawned processes (see
:mod:`prefix_sharing.engines.launch`), so megatron's global state never leaks into the pytest
process or from one test into the next.
"""

from __future__ import annotations

from typing import Any

import torch

from prefix_sharing.engines.launch import run_distributed
from prefix_sharing.presets import PRESETS, sharp

__all__ = ["PRESET", "run_distributed", "tiny_gpt"]

PRESET = sharp(PRESETS["tiny"])  # 2 layers, hidden 64, 4 query heads over 2 K/V groups, vocab 512


def tiny_gpt(layout: str = "shared", **overrides: Any) -> torch.nn.Module:
    """This rank's stage of the tiny preset's GPTModel, seeded weights; ``overrides`` are
    TransformerConfig fields (or ``dtype`` / ``layer_spec``). Call it inside a rank."""
    from prefix_sharing.engines.megatron import gpt_model

    return gpt_model(PRESET, layout=layout, **overrides)
