"""Refuse to run a sharing plan through a model in which some attention or router is stock.

:func:`~.layer_specs.with_prefix_sharing` swaps every layer it recognises and raises on the
rest, but a model can be built other ways: a hand-made spec, a framework's own builder, a layer
spec that took a new form in a later megatron-core. A stock module left in such a model reads
the flat layout as if it were the plain batch - a stock router computes its load-balancing
statistics on the deduplicated rows, a stock attention misses the shared prefix - and nothing
would fail. So the entry points that run a plan through a model call
:func:`check_sharing_model` first; it walks the model's modules once per model.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.moe.router import Router

from .checks import UnsupportedSetupError
from .core_attention import PrefixSharingCoreAttention
from .mla import PrefixSharingMLASelfAttention
from .moe import PrefixSharingRouter
from .self_attention import PrefixSharingSelfAttention

_SHARING_ATTENTION = (PrefixSharingSelfAttention, PrefixSharingMLASelfAttention)

__all__ = ["check_sharing_model", "stock_modules"]

# Models already found sharing throughout (a walk is per model, not per micro-batch).
_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def stock_modules(model: torch.nn.Module) -> list[str]:
    """``"name (Class)"`` of every attention, core attention or router of ``model`` that would
    not serve a sharing plan: not the prefix-sharing class, or a sharing router that no layer
    hands the plan to."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            core = getattr(module, "core_attention", None)
            if not isinstance(module, _SHARING_ATTENTION):
                found.append(f"{name} ({type(module).__qualname__})")
            elif not isinstance(core, PrefixSharingCoreAttention):
                found.append(f"{name}.core_attention ({type(core).__qualname__})")
        elif isinstance(module, Router):
            if not isinstance(module, PrefixSharingRouter):
                found.append(f"{name} ({type(module).__qualname__})")
            elif module.fed_by is None:
                found.append(f"{name} (PrefixSharingRouter that no layer hands a plan)")
    return found


def check_sharing_model(model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
    """Raises unless every attention and MoE router of ``model`` (or of each model chunk) is
    the prefix-sharing one.

    Raises:
        UnsupportedSetupError: naming each stock module found.
    """
    for chunk in model if isinstance(model, Sequence) else [model]:
        if chunk in _CHECKED:
            continue
        found = stock_modules(chunk)
        if found:
            raise UnsupportedSetupError(
                "a sharing plan would run through stock modules, which would read the flat "
                f"layout as the plain batch: {', '.join(found)}; build the model from a layer "
                "spec made by prefix_sharing.megatron_ext.with_prefix_sharing"
            )
        _CHECKED.add(chunk)
