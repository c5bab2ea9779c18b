"""Weights by global parameter name: seeded alike, and gradients gathered alike, whatever the
parallel layout (tensor-parallel shards cut and joined the way megatron shards them, layers and
experts named by their number in the whole model)."""

from __future__ import annotations

import re
import zlib

import torch

__all__ = ["full_grads", "seed_weights"]


def seed_weights(model: torch.nn.Module, seed: int, std: float = 0.05) -> None:
    """Fills every parameter from a generator seeded by its global name and ``seed``.

    The full (TP=1) tensor is drawn, then this rank's shard is cut from it the way megatron
    shards it (``partition_stride`` chunks dealt round-robin), so every layout gets the same
    model. Norm weights near 1, everything else normal with standard deviation ``std`` (the
    preset's ``init_std``); so are MoE routers' expert-bias buffers.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = list(param.shape)
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded:
                shape[param.partition_dim] *= tp_size
            global_name = _global_name(model, name)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
            full = torch.randn(shape, generator=gen)
            is_norm = "norm" in global_name and global_name.endswith("weight")
            full = 1 + 0.1 * full if is_norm else std * full
            if sharded:
                chunks = full.chunk(tp_size * _stride(param), dim=param.partition_dim)
                full = torch.cat(chunks[tp_rank::tp_size], dim=param.partition_dim)
            param.copy_(full)
        for name, buffer in model.named_buffers():
            # an MoE router's expert bias (a buffer, zero when built): random, so that the
            # bias it adds to the expert choice is exercised too
            if name.endswith("router.expert_bias"):
                gen = torch.Generator().manual_seed(
                    seed * 1_000_003 + zlib.crc32(_global_name(model, name).encode()))
                buffer.copy_(std * torch.randn(buffer.shape, generator=gen))


def _stride(param: torch.nn.Parameter) -> int:
    """A tensor-parallel parameter's ``partition_stride``; megatron's GDN marks its
    convolution and gate parameters split along dim 0 without one (stride 1)."""
    return getattr(param, "partition_stride", 1)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's gradients, tensor-parallel shards gathered to TP=1 shape, by global name
    (experts by their global index, so an expert-parallel rank holds its own experts' only).

    Collective over the tensor-parallel group: every TP rank must call it.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "tensor_model_parallel", False):
            dim, stride = param.partition_dim, _stride(param)
            shards = [torch.empty_like(grad) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, grad, group=group)
            per_shard = [shard.chunk(stride, dim=dim) for shard in shards]
            grad = torch.cat([chunks[s] for s in range(stride) for chunks in per_shard], dim=dim)
        grads[_global_name(model, name)] = grad.cpu()
    return grads


# an expert's local index: SequentialMLP's ``local_experts.<i>.``, TEGroupedMLP's ``weight<i>``
_LOCAL_EXPERT = re.compile(r"(?<=\.experts\.local_experts\.)\d+(?=\.)"
                           r"|(?<=\.experts\.linear_fc[12]\.weight)\d+$"
                           r"|(?<=\.experts\.linear_fc[12]\.bias)\d+$")


def _global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` with its stage- and rank-local numbers made global: ``decoder.layers.<i>`` the
    layer's number in the whole model, an expert's local index ``i`` the global
    ``ep_rank * num_local_experts + i``; so every pipeline- and expert-parallel layout names,
    and seeds, a parameter alike. (Legacy ``GroupedMLP`` holds all local experts in one
    ``weight1`` / ``weight2`` and keeps its name.)"""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    if _LOCAL_EXPERT.search(rest):
        from megatron.core import parallel_state

        ep_size = parallel_state.get_expert_model_parallel_world_size()
        offset = parallel_state.get_expert_model_parallel_rank() * (
            model.config.num_moe_experts // ep_size)
        rest = _LOCAL_EXPERT.sub(lambda m: str(offset + int(m.group())), rest)
    return f"{prefix}{model.decoder.layers[int(local)].layer_number - 1}.{rest}"
