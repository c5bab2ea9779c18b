"""Refuse to run a sharing plan through a model in which some attention or router is stock.

:func:`~.layer_specs.with_prefix_sharing` swaps every layer it recognises and raises on the
rest, but a model can be built other ways: a hand-made spec, a framework's own builder, a layer
spec that took a new form in a later megatron-core. A stock module left in such a model reads
the flat layout as if it were the plain batch - a stock router computes its load-balancing
statistics on the deduplicated rows, a stock attention misses the shared prefix, a stock Gated
DeltaNet or Mamba mixer starts every reuser's tail from a zero state - and nothing would fail. So the entry points that run a plan through a model call
:func:`check_sharing_model` first; it walks the model's modules once per model.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

from ..refusals import refuse
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
    """``"name (Class)"`` of every attention, core attention, router or recurrent mixer (Gated
    DeltaNet, Mamba) of ``model`` that would not serve a sharing plan: not the prefix-sharing
    class, or a sharing router that no layer hands the plan to."""
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
        elif _is_stock_recurrent_mixer(module):
            found.append(f"{name} ({type(module).__qualname__})")
    return found


# megatron's recurrent mixers, by (module prefix, class name): told by name, so that releases
# without them (or where they live elsewhere) need not import them
_RECURRENT_MIXERS = (("megatron.core.ssm.gated_delta_net", "GatedDeltaNet"),
                     ("megatron.core.ssm.mamba_mixer", "MambaMixer"))
_SHARING_MIXER = ("prefix_sharing.megatron_ext.gated_delta_net", "PrefixSharingGatedDeltaNet")


def _is_stock_recurrent_mixer(module: torch.nn.Module) -> bool:
    """A Gated DeltaNet or Mamba mixer (or subclass) that is not the prefix-sharing GDN."""
    classes = [(cls.__module__, cls.__name__) for cls in type(module).__mro__]
    if _SHARING_MIXER in classes:
        return False
    return any(mod.startswith(prefix) and cls == name
               for mod, cls in classes for prefix, name in _RECURRENT_MIXERS)


def _unshared_mtp(chunk: torch.nn.Module) -> str | None:
    """What of ``chunk``'s multi-token prediction is not the sharing one (:mod:`.mtp`): a
    stock MTP layer, or the model's stock ``_postprocess``; None when it has no MTP block or
    all of it shares."""
    from .mtp import PrefixSharingMTPLayer, serves_multi_token_prediction

    blocks = [(name, block) for name, block in chunk.named_modules()
              if isinstance(block, MultiTokenPredictionBlock)]
    for name, block in blocks:
        stock = [f"{name}.layers.{i}" for i, layer in enumerate(getattr(block, "layers", ()))
                 if not isinstance(layer, PrefixSharingMTPLayer)]
        if stock:
            return (f"stock MTP layers {', '.join(stock)} (build the MTP block spec with "
                    "with_prefix_sharing, or call share_multi_token_prediction(model))")
    owners = [module for module in chunk.modules() if isinstance(
        getattr(module, "mtp", None), MultiTokenPredictionBlock)]
    if any(not serves_multi_token_prediction(owner) for owner in owners):
        return "the model's stock _postprocess (call share_multi_token_prediction(model))"
    return None


def check_sharing_model(model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
    """Raises unless every attention, MoE router and recurrent mixer of ``model`` (or of each
    model chunk) is the prefix-sharing one, and so is its multi-token prediction, if any.

    Raises:
        UnsupportedSetupError: naming what of the MTP is stock, or each stock module found.
    """
    for chunk in model if isinstance(model, Sequence) else [model]:
        if chunk in _CHECKED:
            continue
        unshared = _unshared_mtp(chunk)
        if unshared:
            raise refuse("megatron.mtp", unshared, error=UnsupportedSetupError)
        found = stock_modules(chunk)
        if found:
            raise refuse("megatron.stock_modules", ", ".join(found), error=UnsupportedSetupError)

        _CHECKED.add(chunk)
