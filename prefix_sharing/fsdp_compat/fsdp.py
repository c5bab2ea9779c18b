"""FSDP2 wrapping of a HuggingFace causal LM that uses the sharing attention, and the whole
gradients of an FSDP2- or FSDP1-wrapped model.

Sharing changes nothing FSDP sees: parameters are gathered per decoder layer as usual, and the
plan travels in the forward's keywords, which ``fully_shard``'s hooks pass through. Every rank
plans its own micro-batch; no communication is added.
"""

from __future__ import annotations

from typing import Any

import torch

from .vlm import is_vlm

__all__ = ["shard_model", "full_gradients"]


def shard_model(
    model: torch.nn.Module,
    *,
    mesh: Any = None,
    gradient_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Shards ``model`` in place with ``fully_shard``: each decoder layer (and a VLM's vision
    blocks), then the root.

    Args:
        model: a transformers causal LM (call ``enable_prefix_sharing`` on it first).
        mesh: a 1-D device mesh; the whole default process group when ``None``.
        gradient_checkpointing: recompute each decoder layer in backward (transformers'
            non-reentrant checkpointing, which replays the layer with the same keywords,
            the plan included).
        reshard_after_forward: as in ``fully_shard``.
    """
    from torch.distributed.fsdp import fully_shard

    if gradient_checkpointing:
        _enable_checkpointing(model)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None and is_vlm(model):  # its decoder layers and its vision tower's blocks
        layers = [*inner.language_model.layers, *inner.visual.blocks]
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to shard per decoder layer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder layer (transformers 5 renamed the method)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by its model name (collective on all ranks): FSDP2's
    sharded ones gathered, and FSDP1's flat parameters (``use_orig_params=False``, verl's
    default) gathered and split back into the parameters they hold."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if hasattr(param, "_fqns"):  # an FSDP1 FlatParameter
            grads.update(_flat_gradients(name, param))
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad.detach().clone()
    return grads


def _flat_gradients(name: str, flat: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The gradients of the parameters FSDP1 flattened into ``flat`` (named ``name``): each
    rank holds an equal, padded shard of the flat gradient."""
    import torch.distributed as dist

    grad = flat.grad.detach()
    unsharded = flat._unpadded_unsharded_size.numel()
    if grad.numel() < unsharded:  # sharded: gather every rank's piece
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, grad.contiguous())
        grad = torch.cat(pieces)
    values = iter(grad[:unsharded].split(list(flat._numels_with_padding)))
    prefix = name.replace("_fsdp_wrapped_module.", "").removesuffix("_flat_param")
    grads = {}
    names = iter(zip(flat._fqns, flat._shapes))
    for value, padding in zip(values, flat._is_padding_mask):
        if not padding:
            fqn, shape = next(names)
            grads[prefix + fqn] = value.view(shape).clone()
    return grads
