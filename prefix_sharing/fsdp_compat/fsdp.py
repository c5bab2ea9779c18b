"""FSDP2 wrapping of a HuggingFace causal LM that uses the sharing attention.

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
    """Every parameter's whole gradient by name (sharded ones gathered: collective on all ranks)."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        grads[name] = grad.detach().clone()
    return grads
