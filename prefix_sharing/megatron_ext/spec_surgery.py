"""Spec surgery: the sharing copy of one layer's or one MoE block's spec, a submodule swapped.

The pieces :mod:`.layer_specs` (GPT layers and blocks) and :mod:`.hybrid` (a hybrid stack's
layers) both compose: the sharing attention (absolute rotary positions, K/V injection), the
sharing Gated DeltaNet mixer, the sharing router, and :func:`replaced`, a copy of a spec with
some submodules replaced. A leaf below both, so neither needs the other.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from ..refusals import refuse
from .checks import UnsupportedSetupError
from .core_attention import PrefixSharingCoreAttention
from .mla import PrefixSharingMLASelfAttention
from .moe import PrefixSharingRouter
from .release import installed_release
from .self_attention import PrefixSharingSelfAttention

__all__ = [
    "UnsupportedSpecError",
    "built_class",
    "describe",
    "is_gated_delta_net",
    "is_subclass",
    "mlp_with_router",
    "moe_router",
    "replaced",
    "sharing_attention_layer",
    "sharing_gdn_layer",
    "sharing_router_mlp",
]


class UnsupportedSpecError(UnsupportedSetupError, ValueError):
    """A layer or block spec whose form :func:`with_prefix_sharing` does not recognise."""


def sharing_attention_layer(layer_spec: ModuleSpec, where: str) -> ModuleSpec:
    """A copy of a layer spec with the sharing self-attention (absolute rotary positions; the
    MLA one for ``MLASelfAttention``) and core attention (K/V injection); also the hybrid
    stack's attention layers use it."""
    attention = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    sharing = None
    if isinstance(layer_spec, ModuleSpec) and isinstance(attention, ModuleSpec):
        if is_subclass(attention.module, SelfAttention):
            sharing = PrefixSharingSelfAttention
        elif is_subclass(attention.module, MLASelfAttention):
            sharing = PrefixSharingMLASelfAttention
    if sharing is None:
        raise refuse("megatron.spec.attention", f"{where} has self_attention={describe(attention)}",
                     error=UnsupportedSpecError)
    attention = replaced(attention, core_attention=ModuleSpec(module=PrefixSharingCoreAttention))
    attention.module = sharing
    return replaced(layer_spec, self_attention=attention)


def sharing_gdn_layer(layer_spec: ModuleSpec, where: str) -> ModuleSpec:
    """A copy of a layer spec whose Gated DeltaNet mixer (``self_attention``) is the sharing
    one, everything else (input norm, projections' classes, output norm, MLP) kept.

    Raises:
        UnsupportedSpecError: on a megatron-core other than 0.19.2, naming the installed one;
            or when ``self_attention`` is not a ``GatedDeltaNet`` ``ModuleSpec``.
    """
    mixer = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    if not (isinstance(layer_spec, ModuleSpec) and isinstance(mixer, ModuleSpec)
            and is_gated_delta_net(mixer.module)):
        raise refuse("megatron.spec.gdn_mixer", f"{where} has self_attention={describe(mixer)}",
                     error=UnsupportedSpecError)
    try:
        from .gated_delta_net import PrefixSharingGatedDeltaNet
    except ImportError as error:
        raise refuse("megatron.gdn_release", f"{where} on megatron-core {installed_release()}",
                     error=UnsupportedSpecError) from error
    if not issubclass(PrefixSharingGatedDeltaNet, mixer.module):
        raise refuse("megatron.spec.gdn_mixer", f"{where}'s mixer is {mixer.module.__qualname__}",
                     error=UnsupportedSpecError)
    mixer = copy.copy(mixer)
    mixer.module = PrefixSharingGatedDeltaNet
    return replaced(layer_spec, self_attention=mixer)


def is_gated_delta_net(module: Any) -> bool:
    """Whether ``module`` is megatron's GatedDeltaNet or a subclass (told by name, so that it
    works on every release, wherever the class lives)."""
    return inspect.isclass(module) and any(
        cls.__name__ == "GatedDeltaNet"
        and cls.__module__.startswith("megatron.core.ssm.gated_delta_net")
        for cls in module.__mro__)


def sharing_router_mlp(mlp: ModuleSpec | functools.partial, where: str) -> Any:
    """The MoE spec ``mlp`` (a ``ModuleSpec`` up to megatron-core 0.17 or a ``partial`` from
    0.18) with the sharing router."""
    router = moe_router(mlp)
    if router not in (TopKRouter, PrefixSharingRouter):
        raise refuse("megatron.spec.router", f"{where}'s MoE router is {describe(router)}",
                     error=UnsupportedSpecError)

    return mlp_with_router(mlp, PrefixSharingRouter)


def moe_router(mlp: Any) -> Any:
    """The router class of an MoE spec ``mlp`` (either form), or None."""
    submodules = (mlp.submodules if isinstance(mlp, ModuleSpec)
                  else getattr(mlp, "keywords", {}).get("submodules"))
    return getattr(submodules, "router", None)


def mlp_with_router(mlp: ModuleSpec | functools.partial, router: type) -> Any:
    """A copy of the MoE spec ``mlp`` (either form) with ``router`` as its router."""
    if isinstance(mlp, ModuleSpec):
        return replaced(mlp, router=router)
    submodules = dataclasses.replace(mlp.keywords["submodules"], router=router)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})


def replaced(spec: ModuleSpec, **submodules: Any) -> ModuleSpec:
    """A copy of ``spec`` with some submodules replaced, the rest shared rather than deep-copied
    (without Transformer Engine the stock TE specs hold stand-ins that cannot be copied)."""
    spec = copy.copy(spec)
    spec.submodules = dataclasses.replace(spec.submodules, **submodules)
    return spec


def built_class(spec: Any) -> type | None:
    """The class a submodule spec builds: a ``ModuleSpec``'s module, a ``partial``'s class or
    the class of its classmethod (``MLP.as_mlp_submodule``), a class itself; else None."""
    if isinstance(spec, ModuleSpec):
        spec = spec.module
    elif isinstance(spec, functools.partial):
        spec = spec.func
    if inspect.ismethod(spec) and inspect.isclass(spec.__self__):
        spec = spec.__self__
    return spec if inspect.isclass(spec) else None


def is_subclass(module: Any, base: type) -> bool:
    return inspect.isclass(module) and issubclass(module, base)


def describe(spec: Any) -> str:
    """A spec's form for an error message: its type and what it builds."""
    built = getattr(spec, "module", getattr(spec, "func", spec))
    name = getattr(built, "__qualname__", repr(built))
    return f"{type(spec).__qualname__}({name})" if built is not spec else name
