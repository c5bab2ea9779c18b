"""The HuggingFace engine: a transformers causal LM of a preset's shape, plain and shared.

``verify``: the plain run is transformers' own ``sdpa`` attention on the padded batch (no code of
this package on its path), the shared run :func:`~prefix_sharing.fsdp_compat.shared_forward` on
the plan; both are judged against the plain run repeated in higher precision, as for megatron
(:func:`~prefix_sharing.engines.verify.summarize`). ``bench``: the plain packed step, the shared
and prompt-only steps, and PrefixGrouper's step on the same model and weights. A
vision-language preset (``image_grid``) gets one synthetic image in every prompt
(:func:`with_images`); its steps pass the images to the forward (plain and shared alike encode
each distinct image of the micro-batch once, so the step times compare the language model's
work) and its results add ``vision``: the images and vision tokens a stock step encodes and
computes, and those the shared step does.

A preset with experts is built as Qwen3-MoE, one with q/k/v biases as Qwen2, any other as
Llama. FSDP shards a model across
data-parallel ranks without changing any micro-batch's result (the FSDP2 tests check this), so
both jobs run one unsharded model in this process; tensor and pipeline parallelism are
megatron's.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import zlib

import torch

from ..config import PrefixSharingConfig
from ..equivalence import advantages, compare_runs, pg_loss
from ..errors import InputError, MissingPackageError
from ..planner import PromptGroup
from ..presets import ModelPreset
from .bench import (BenchRequest, BenchWorkload, Progress, keep_freed_memory_in_heap,
                    time_workload)
from .verify import VerifyRequest, reference_dtype, summarize

__all__ = ["HFEngine", "family_of", "with_images", "IMAGE_AFTER"]

IMAGE_AFTER = 8  # tokens of each sequence before its image


def family_of(preset: ModelPreset) -> str:
    """The transformers family a preset is built as: its own, else gpt-oss for learned sinks,
    Qwen3-MoE for experts, Qwen2 for q/k/v biases, Llama otherwise; an MLA preset has none
    here (InputError)."""
    if preset.hf_family is not None:
        return preset.hf_family
    if preset.mla is not None:
        raise InputError(f"the {preset.name} preset (multi-latent attention) runs on the "
                         "megatron engine only: --engine megatron")
    if preset.softmax_type == "learnable":
        return "gpt_oss"
    if preset.num_experts:
        return "qwen3_moe"
    return "qwen2" if preset.add_qkv_bias else "llama"


@dataclasses.dataclass(frozen=True)
class HFEngine:
    """The engine contract of :class:`prefix_sharing.engines.Engine`, on transformers."""

    name: str = "hf"
    package: str = "transformers"
    pip_extra: str = "hf"

    def check_installed(self) -> None:
        for package in (self.package, "prefix_grouper"):
            if importlib.util.find_spec(package) is None:
                raise MissingPackageError(f"the {self.name} engine needs {package} "
                                          f"(pip install 'prefix-sharing[{self.pip_extra}]')")

    def check_layout(self, model: ModelPreset, tp: int, pp: int, cp: int = 1) -> None:
        if (tp, pp, cp) != (1, 1, 1):
            raise InputError(f"the {self.name} engine shards data-parallel (FSDP) only: --tp, "
                             f"--pp and --cp must be 1; got tp={tp}, pp={pp}, cp={cp} "
                             "(use --engine megatron)")

    def verify(self, request: VerifyRequest, tp: int = 1, pp: int = 1,
               cp: int = 1) -> list[dict]:
        """One report per micro-batch, in :func:`~prefix_sharing.engines.verify.summarize`'s form."""
        self.check_installed()
        self.check_layout(request.preset, tp, pp, cp)
        steps = [_verify_batch(request, sequences, groups) for sequences, groups in request.batches]
        return [summarize([steps], i, request.dtype) for i in range(len(steps))]

    def bench(self, request: BenchRequest) -> list[dict]:
        self.check_installed()
        return _bench(request)


def _verify_batch(request: VerifyRequest, sequences: list[torch.Tensor], groups) -> list[dict]:
    from ..fsdp_compat import build_model, enable_prefix_sharing
    from ..fsdp_compat.runs import plain_run, shared_run

    plain = build_model(family_of(request.preset), request.preset, dtype=request.dtype,
                        seed=request.seed, attn_implementation="sdpa")
    shared = enable_prefix_sharing(copy.deepcopy(plain))
    reference = copy.deepcopy(plain).to(reference_dtype(request.dtype))
    if hasattr(reference, "set_experts_implementation"):  # transformers 5: grouped experts
        reference.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    optimizer = torch.optim.Adam(plain.parameters(), lr=request.lr)
    weights = advantages(sum(len(s) for s in sequences), seed=0)
    steps = []
    for _ in range(request.steps):
        # the shared and the reference model compute with the plain model's (rounded) weights
        for model in (shared, reference):
            model.load_state_dict(plain.state_dict())
        shared_out = shared_run(shared, sequences, weights, request.config, groups)
        plain_out = plain_run(plain, sequences, weights)
        reference_out = plain_run(reference, sequences, weights)
        steps.append({"shared": compare_runs(shared_out, reference_out),
                      "plain": compare_runs(plain_out, reference_out),
                      "vs_plain": compare_runs(shared_out, plain_out),
                      "digest": _plan_digest(sequences, request.config, groups)})
        optimizer.step()
    return steps


def _plan_digest(sequences, config: PrefixSharingConfig, groups) -> str:
    from ..planner import build_plan

    return build_plan(sequences, config, groups=groups).digest()


# ----------------------------------------------------------------------------- bench
def _bench(request: BenchRequest) -> list[dict]:
    from ..fsdp_compat import build_model, enable_prefix_sharing
    from ..fsdp_compat.prefix_grouper_peer import register_peer_attention

    if not torch.cuda.is_available():
        keep_freed_memory_in_heap()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(family_of(request.preset), request.preset, dtype=request.dtype)
    model = enable_prefix_sharing(model.to(device))
    register_peer_attention()
    if request.preset.image_grid is not None:
        request = dataclasses.replace(request, workloads=[
            with_images(w, model.config, request.preset.image_grid, request.dtype, device)
            for w in request.workloads])
    per_step = request.warmup + request.repeats
    total = sum(per_step * (2 + 2 * (w.groups is not None)) for w in request.workloads)
    progress = Progress(total, request.progress)
    results = [time_workload(model, w, request, progress, make_step=_step,
                             peers=_prefix_grouper_peer(model, w)) for w in request.workloads]
    progress.close()
    for result, workload in zip(results, request.workloads):
        if workload.multi_modal_inputs is not None:
            result["vision"] = _vision_counts(model, workload, request.config)
    return results


def with_images(workload: BenchWorkload, config, grid: tuple[int, int, int],
                dtype: torch.dtype, device: str) -> BenchWorkload:
    """``workload`` with an image after each sequence's first :data:`IMAGE_AFTER` tokens:
    ``vision start, one placeholder per merged patch, vision end``, of random pixels
    seeded by those tokens, so sequences that share them share the image (each GRPO group its
    prompt's) and the plan of tokens and images is the plan of the tokens alone. Prompt groups
    grow by the inserted run."""
    t, h, w = grid
    vision = config.vision_config
    features = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    run = [config.vision_start_token_id] + [config.image_token_id] * (
        t * h * w // vision.spatial_merge_size**2) + [config.vision_end_token_id]
    sequences, mm = [], []
    for seq in workload.sequences:
        head = seq[:IMAGE_AFTER]
        gen = torch.Generator().manual_seed(zlib.crc32(head.numpy().tobytes()))
        pixels = torch.randn(t * h * w, features, generator=gen).to(device, dtype)
        mm.append({"pixel_values": pixels, "image_grid_thw": torch.tensor([list(grid)])})
        sequences.append(torch.cat([head, torch.tensor(run, dtype=seq.dtype), seq[IMAGE_AFTER:]]))
    groups = None if workload.groups is None else [  # a shorter prompt holds no image
        PromptGroup(g.prompt_len + len(run) * (g.prompt_len >= IMAGE_AFTER), g.members)
        for g in workload.groups]
    return BenchWorkload(workload.name, sequences, groups, mm)


def _vision_counts(model: torch.nn.Module, workload: BenchWorkload,
                   config: PrefixSharingConfig) -> dict[str, int]:
    """Images and vision tokens: of the stock step (``*_total``), of the shared step."""
    from ..fsdp_compat.vision import vision_batch
    from ..planner import build_plan

    images = vision_batch(model.config, workload.sequences, workload.multi_modal_inputs)
    plan = build_plan(workload.sequences, config, images=images.tags)
    return {k: int(v) for k, v in images.metrics(plan, prefix="").items()}


def _step(model: torch.nn.Module, workload: BenchWorkload, config: PrefixSharingConfig):
    """One training step on the plan of ``config`` (``mode="off"``: the plain packed step)."""
    from ..fsdp_compat import ATTENTION_NAME, shared_forward
    from ..fsdp_compat.vlm import is_vlm

    groups = workload.groups if config.mode == "prompt_only" else None
    # the peer's step switches the attention away; a VLM's vision tower keeps its own
    attention = {"text_config": ATTENTION_NAME} if is_vlm(model) else ATTENTION_NAME

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation(attention)
        stats = shared_forward(model, workload.sequences, config, groups=groups,
                               multi_modal_inputs=workload.multi_modal_inputs).stats
        weights = advantages(stats.log_probs.numel(), seed=0).to(stats.log_probs.device)
        pg_loss(stats.log_probs, stats.entropy, weights).backward()

    return step


def _prefix_grouper_peer(model: torch.nn.Module, workload: BenchWorkload) -> dict:
    """PrefixGrouper's step on a grouped batch (none for a batch without prompt groups, nor for
    a Gated DeltaNet or Mamba-2 hybrid: PrefixGrouper shares attention only, nor with images);
    the tokens it computes are its padded grid, ``groups x longest group``."""
    from ..fsdp_compat import HYBRID_FAMILIES, MAMBA_HYBRID_FAMILIES
    from ..fsdp_compat.prefix_grouper_peer import (PEER_ATTENTION_NAME, grouped_batch,
                                                   prefix_grouper_forward)

    if workload.groups is None or workload.multi_modal_inputs is not None or (
            model.config.model_type in (*HYBRID_FAMILIES, *MAMBA_HYBRID_FAMILIES)):
        return {}
    device = model.get_input_embeddings().weight.device

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model.set_attn_implementation(PEER_ATTENTION_NAME)
        batch = grouped_batch(workload.sequences, workload.groups, device)
        stats = prefix_grouper_forward(model, workload.sequences, workload.groups, batch)
        log_probs, entropy = torch.cat(stats.log_probs), torch.cat(stats.entropy)
        weights = advantages(log_probs.numel(), seed=0).to(device)
        pg_loss(log_probs, entropy, weights).backward()

    tokens = grouped_batch(workload.sequences, workload.groups).input_ids.numel()
    return {"prefix_grouper": (step, tokens)}
