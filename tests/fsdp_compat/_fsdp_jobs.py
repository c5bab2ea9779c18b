"""Jobs that run inside spawned gloo ranks (importable by name, as the launcher requires)."""

from __future__ import annotations

import copy

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.equivalence import Comparison, advantages, compare_runs
from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
from prefix_sharing.fsdp_compat.fsdp import shard_model
from prefix_sharing.fsdp_compat.runs import plain_run, shared_run
from prefix_sharing.presets import PRESETS
from prefix_sharing.workloads import make_workload

# Each rank trains on its own micro-batch, as data parallelism does.
RANK_WORKLOADS = ("grpo", "tree")


def fsdp_equivalence_job(rank: int, family: str) -> dict[bool, tuple[Comparison, int]]:
    """Plain and shared FSDP2 models on this rank's micro-batch, without and with gradient
    checkpointing; per setting, the shared run against the plain one, and how many times the
    shared model's attention layers ran (twice per layer when checkpointing recomputes them).

    Gradients are reduced over both ranks, so they compare the whole data-parallel step.
    """
    preset = PRESETS["tiny"]
    workload = make_workload(RANK_WORKLOADS[rank], vocab_size=preset.vocab_size)
    weights = advantages(workload.num_tokens, seed=rank)
    config = PrefixSharingConfig(min_prefix_len=1)
    results = {}
    for checkpointing in (False, True):
        plain = build_model(family, preset, attn_implementation="sdpa")
        shared = enable_prefix_sharing(copy.deepcopy(plain))
        for model in (plain, shared):
            shard_model(model, gradient_checkpointing=checkpointing).train()
        calls = []
        for layer in shared.model.layers:
            layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
        comparison = compare_runs(shared_run(shared, workload.sequences, weights, config),
                                  plain_run(plain, workload.sequences, weights))
        results[checkpointing] = (comparison, len(calls))
    return results


def fsdp_hybrid_job(rank: int, family: str, preset_name: str) -> tuple[Comparison, int]:
    """A hybrid preset (tiny-hybrid as Qwen3.5: 3 Gated DeltaNet layers, 1 attention layer;
    tiny-nemotron-h as Nemotron-H: 2 Mamba-2 mixers, MLP, attention, MoE) in float64 under
    FSDP2 with gradient checkpointing, plain and shared, on this rank's micro-batch; the
    comparison and how many times the shared recurrent layers were called (twice per layer:
    checkpointing recomputes them in backward, with the plan in their keywords)."""
    import torch

    preset = PRESETS[preset_name]
    workload = make_workload(RANK_WORKLOADS[rank], vocab_size=preset.vocab_size)
    weights = advantages(workload.num_tokens, seed=rank)
    plain = build_model(family, preset, dtype=torch.float64)
    if hasattr(plain, "set_experts_implementation"):
        plain.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    shared = enable_prefix_sharing(copy.deepcopy(plain))
    for model in (plain, shared):
        shard_model(model, gradient_checkpointing=True).train()
    calls = []
    for module in shared.modules():
        if getattr(module, "_prefix_sharing_gdn", False) or getattr(
                module, "_prefix_sharing_mamba", False):
            # a pre-hook: the recompute stops early (torch's non-reentrant checkpointing) once
            # it has what backward needs - inside a Nemotron-H block's mixer, its last module
            module.register_forward_pre_hook(lambda *_: calls.append(1))
    comparison = compare_runs(
        shared_run(shared, workload.sequences, weights, PrefixSharingConfig(min_prefix_len=1)),
        plain_run(plain, workload.sequences, weights))
    return comparison, len(calls)


def fsdp_vlm_job(rank: int, family: str) -> tuple[Comparison, int]:
    """A float64 vision-language model under FSDP2 with gradient checkpointing, plain
    (transformers' model sequence by sequence) and shared, on this rank's image batch (rank 0:
    a group sharing its image; rank 1: token-identical prompts over two images; both 4
    sequences with an image each, so the ranks' vision towers run in step); the comparison and
    how many distinct images the shared forward encoded."""
    from prefix_sharing.fsdp_compat import shared_forward
    from prefix_sharing.fsdp_compat.runs import plain_vlm_run

    from ._vlm import vlm_models
    from .test_vlm import grpo_image_batch, two_groups

    plain, shared = vlm_models(family)
    for model in (plain, shared):
        shard_model(model, gradient_checkpointing=True).train()
    batch = grpo_image_batch(plain.config) if rank == 0 else two_groups(plain.config)[0]
    weights = advantages(sum(s.numel() for s in batch.sequences), seed=rank)
    config = PrefixSharingConfig(min_prefix_len=1)
    comparison = compare_runs(
        shared_run(shared, batch.sequences, weights, config, multi_modal_inputs=batch.mm),
        plain_vlm_run(plain, batch.sequences, weights, batch.mm))
    out = shared_forward(shared, batch.sequences, config, multi_modal_inputs=batch.mm)
    return comparison, out.images.images_computed
