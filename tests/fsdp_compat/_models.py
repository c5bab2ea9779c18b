"""The tiny HF models the tests run: a plain one and its sharing twin on the same weights."""

from __future__ import annotations

import copy

import torch

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.equivalence import Comparison, advantages, compare_runs
from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
from prefix_sharing.fsdp_compat.runs import plain_run, shared_run
from prefix_sharing.presets import PRESETS, sharp
from prefix_sharing.workloads import Workload

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
PRESET = sharp(PRESETS["tiny"])  # 2 layers, hidden 64, 4 query heads over 2 K/V heads, vocab 512


def plain_and_shared(family: str = "llama", attn_implementation: str = "sdpa",
                     dtype: torch.dtype = torch.float32, **overrides) -> tuple:
    """``(plain, shared)``: the same seeded weights, the shared one on the sharing attention."""
    plain = build_model(family, PRESET, attn_implementation=attn_implementation, dtype=dtype,
                        **overrides)
    return plain, enable_prefix_sharing(copy.deepcopy(plain))


def compare_shared_to_plain(plain: torch.nn.Module, shared: torch.nn.Module, workload: Workload,
                            config: PrefixSharingConfig = EVERY_PREFIX) -> Comparison:
    """One policy-gradient step of ``workload``: ``shared_forward`` on ``shared`` against
    transformers' own forward of ``plain``, sequence by sequence (prompt groups for
    ``prompt_only``)."""
    weights = advantages(workload.num_tokens, seed=0)
    groups = workload.groups if config.mode == "prompt_only" else None
    return compare_runs(shared_run(shared, workload.sequences, weights, config, groups),
                        plain_run(plain, workload.sequences, weights))
