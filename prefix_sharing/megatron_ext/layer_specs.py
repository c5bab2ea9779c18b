"""GPT layer specs with prefix sharing: megatron-core's own specs, a few submodules swapped.

Composition the megatron-core way: take the stock layer spec, copy it, replace
``self_attention.module`` (absolute rotary positions; ``MLASelfAttention`` becomes
:class:`~.mla.PrefixSharingMLASelfAttention`) and
``self_attention.submodules.core_attention`` (K/V injection), keep everything else - norms,
linear layers, MLP or MoE, TE or local flavour. In an MoE layer the router and the layer class
are swapped too, so the router's batch statistics count the plain batch (see :mod:`.moe`). A
layer whose ``self_attention`` is megatron's Gated DeltaNet (the experimental-attention-variant
specs, a hybrid stack's ``G``) gets the sharing GDN mixer instead (:mod:`.gated_delta_net`,
megatron-core 0.19.2; refused, naming that release, on the others).

The forms differ by megatron-core release, and each is recognised by what it is, not by the
release: a layer is a ``ModuleSpec`` of a ``TransformerLayer``; its MoE ``mlp`` a ``ModuleSpec``
of ``MoELayer`` (0.16-0.17) or ``functools.partial(MoELayer, submodules=MoESubmodules(...))``
(0.18+); a block is a ``TransformerBlockSubmodules`` (``get_gpt_decoder_block_spec``) or a list of
layer specs (``get_gpt_decoder_layer_specs``). Anything else raises, naming the layer and the
form: a layer left stock while the others share would silently change the results.
:func:`register_spec_form` is the hook for further whole-model forms (e.g. a hybrid stack).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
from typing import Any, Callable

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from .checks import UnsupportedSetupError
from .release import installed_release
from .core_attention import PrefixSharingCoreAttention
from .mla import PrefixSharingMLASelfAttention
from .moe import PrefixSharingRouter, PrefixSharingTransformerLayer
from .self_attention import PrefixSharingSelfAttention

__all__ = [
    "UnsupportedSpecError",
    "gdn_layer_spec",
    "serves_gated_delta_net",
    "sharing_gdn_layer",
    "with_prefix_sharing",
    "register_spec_form",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
]


class UnsupportedSpecError(UnsupportedSetupError, ValueError):
    """A layer or block spec whose form :func:`with_prefix_sharing` does not recognise."""


# Further spec forms, tried first: (recognises, swap) pairs.
_FORMS: list[tuple[Callable[[Any], bool], Callable[[Any], Any]]] = []


def register_spec_form(recognises: Callable[[Any], bool], swap: Callable[[Any], Any]) -> None:
    """Lets :func:`with_prefix_sharing` convert the specs ``recognises`` accepts (e.g. a hybrid
    stack's) with ``swap``, which must return a copy in which every attention and router is the
    sharing one, or raise :class:`UnsupportedSpecError`."""
    _FORMS.append((recognises, swap))


def with_prefix_sharing(spec: Any) -> Any:
    """A copy of a GPT layer or block spec whose every layer shares prefixes.

    Args:
        spec: a ``TransformerLayer`` ``ModuleSpec`` (any stock GPT layer spec, local or
            Transformer Engine, dense or MoE), a ``TransformerBlockSubmodules`` as
            ``get_gpt_decoder_block_spec`` returns, a list of layer specs as
            ``get_gpt_decoder_layer_specs`` returns, a ``HybridStack`` spec (see
            :mod:`.hybrid`), or a form added with :func:`register_spec_form`.

    Raises:
        UnsupportedSpecError: a form not recognised, naming the layer and the form.
    """
    for recognises, swap in _FORMS:
        if recognises(spec):
            return swap(spec)
    if isinstance(spec, ModuleSpec) and _builds_hybrid_stack(spec):
        from . import hybrid  # megatron-core 0.18+

        return hybrid.with_prefix_sharing(spec)
    if isinstance(spec, ModuleSpec):
        return _sharing_layer(spec, "the layer spec")
    if isinstance(spec, TransformerBlockSubmodules):
        if not isinstance(spec.layer_specs, list):
            raise UnsupportedSpecError(
                "with_prefix_sharing needs a TransformerBlockSubmodules with a list of layer "
                f"specs; got layer_specs={spec.layer_specs!r}"
            )
        return dataclasses.replace(spec, layer_specs=_sharing_layers(spec.layer_specs))
    if isinstance(spec, list):
        return _sharing_layers(spec)
    raise UnsupportedSpecError(
        f"with_prefix_sharing does not recognise a spec of type {type(spec).__qualname__}: give a "
        "TransformerLayer ModuleSpec, a TransformerBlockSubmodules or a list of layer specs"
    )


def _sharing_layers(layer_specs: list) -> list:
    return [_sharing_layer(layer, f"layer {i + 1}") for i, layer in enumerate(layer_specs)]


def _sharing_layer(layer_spec: Any, where: str) -> ModuleSpec:
    """The sharing copy of one ``TransformerLayer`` spec (``where`` names it in errors)."""
    if not (isinstance(layer_spec, ModuleSpec)
            and _is_subclass(layer_spec.module, TransformerLayer)):
        raise UnsupportedSpecError(
            f"with_prefix_sharing: {where} is {_describe(layer_spec)}, not a ModuleSpec of a "
            "TransformerLayer"
        )
    if _is_gated_delta_net(getattr(layer_spec.submodules.self_attention, "module", None)):
        spec = sharing_gdn_layer(layer_spec, where)
    else:
        spec = sharing_attention_layer(layer_spec, where)
    mlp = spec.submodules.mlp
    target = _built_class(mlp)
    if target is None:
        raise UnsupportedSpecError(
            f"with_prefix_sharing: {where} has mlp={_describe(mlp)}, a form whose module it cannot "
            "tell (it must be a ModuleSpec, a functools.partial of a class or classmethod, or a "
            "class), so it cannot tell whether its router would need to be swapped"
        )
    if issubclass(target, BaseMoELayer):
        if spec.module not in (TransformerLayer, PrefixSharingTransformerLayer):
            raise UnsupportedSpecError(
                f"with_prefix_sharing supports MoE in a plain TransformerLayer; {where} is a "
                f"{spec.module.__qualname__}"
            )
        spec = replaced(spec, mlp=sharing_router_mlp(mlp, where))
        spec.module = PrefixSharingTransformerLayer
    return spec


def sharing_attention_layer(layer_spec: ModuleSpec, where: str) -> ModuleSpec:
    """A copy of a layer spec with the sharing self-attention (absolute rotary positions; the
    MLA one for ``MLASelfAttention``) and core attention (K/V injection); also the hybrid
    stack's attention layers use it."""
    attention = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    sharing = None
    if isinstance(layer_spec, ModuleSpec) and isinstance(attention, ModuleSpec):
        if _is_subclass(attention.module, SelfAttention):
            sharing = PrefixSharingSelfAttention
        elif _is_subclass(attention.module, MLASelfAttention):
            sharing = PrefixSharingMLASelfAttention
    if sharing is None:
        raise UnsupportedSpecError(
            f"with_prefix_sharing needs a layer spec whose self_attention is a SelfAttention or "
            f"MLASelfAttention ModuleSpec; {where} has self_attention={_describe(attention)}"
        )
    attention = replaced(attention, core_attention=ModuleSpec(module=PrefixSharingCoreAttention))
    attention.module = sharing
    return replaced(layer_spec, self_attention=attention)


# Why a Gated DeltaNet layer is refused on a release other than 0.19.2 (hybrid.py says it too).
GDN_NOT_SERVED = (
    "Gated DeltaNet: prefix sharing carries its state with megatron-core 0.19.2's GatedDeltaNet "
    "(megatron.core.ssm.gated_delta_net); 0.16.1 and 0.17.1 have no packed path and 0.18.2's "
    "module differs: install megatron-core==0.19.2 (Python >= 3.12)"
)


def serves_gated_delta_net() -> bool:
    """Whether this megatron-core has 0.19.2's Gated DeltaNet package, the module the sharing
    mixer subclasses (before, ``megatron.core.ssm.gated_delta_net`` is a plain module)."""
    try:
        return importlib.util.find_spec("megatron.core.ssm.gated_delta_net.gdn") is not None
    except ModuleNotFoundError:  # no package of that name: 0.16 - 0.18
        return False


def sharing_gdn_layer(layer_spec: ModuleSpec, where: str) -> ModuleSpec:
    """A copy of a layer spec whose Gated DeltaNet mixer (``self_attention``) is the sharing
    one, everything else (input norm, projections' classes, output norm, MLP) kept.

    Raises:
        UnsupportedSpecError: on a megatron-core other than 0.19.2, naming the installed one;
            or when ``self_attention`` is not a ``GatedDeltaNet`` ``ModuleSpec``.
    """
    mixer = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    if not (isinstance(layer_spec, ModuleSpec) and isinstance(mixer, ModuleSpec)
            and _is_gated_delta_net(mixer.module)):
        raise UnsupportedSpecError(
            f"with_prefix_sharing: {where} must be a layer spec whose self_attention is a "
            f"GatedDeltaNet ModuleSpec; got self_attention={_describe(mixer)}"
        )
    try:
        from .gated_delta_net import PrefixSharingGatedDeltaNet
    except ImportError as error:
        raise UnsupportedSpecError(f"with_prefix_sharing: {where} is a {GDN_NOT_SERVED} (this "
                                   f"is megatron-core {installed_release()})") from error
    if not issubclass(PrefixSharingGatedDeltaNet, mixer.module):
        raise UnsupportedSpecError(
            f"with_prefix_sharing: {where}'s mixer is {mixer.module.__qualname__}; only "
            "megatron's GatedDeltaNet is replaced by the prefix-sharing one"
        )
    mixer = copy.copy(mixer)
    mixer.module = PrefixSharingGatedDeltaNet
    return replaced(layer_spec, self_attention=mixer)


def gdn_layer_spec(norm: Any) -> ModuleSpec:
    """A stock Gated DeltaNet layer of megatron's local (TE-free) modules: ``norm`` (the local
    spec's norm class, which follows ``config.normalization``) before the mixer and on its
    output heads, column- and row-parallel linear layers for its projections. The TE form
    (megatron's ``hybrid_stack_spec``) fuses the input norm into the projection instead."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from .cpu_support import enable_cpu_gated_delta_net

    enable_cpu_gated_delta_net()  # in a CPU process: fla's Triton l2norm has no CPU driver

    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
    ))


def _is_gated_delta_net(module: Any) -> bool:
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
        raise UnsupportedSpecError(
            f"with_prefix_sharing: {where}'s MoE router is {_describe(router)}; only megatron's "
            "TopKRouter is replaced by the prefix-sharing router"
        )
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


def _builds_hybrid_stack(spec: ModuleSpec) -> bool:
    """Whether ``spec`` builds megatron-core 0.18+'s ``HybridStack`` (told without importing
    :mod:`.hybrid`, which older releases cannot)."""
    return inspect.isclass(spec.module) and any(
        cls.__name__ == "HybridStack" and cls.__module__.startswith("megatron.core.models.hybrid")
        for cls in spec.module.__mro__)


def _built_class(spec: Any) -> type | None:
    """The class a submodule spec builds: a ``ModuleSpec``'s module, a ``partial``'s class or
    the class of its classmethod (``MLP.as_mlp_submodule``), a class itself; else None."""
    if isinstance(spec, ModuleSpec):
        spec = spec.module
    elif isinstance(spec, functools.partial):
        spec = spec.func
    if inspect.ismethod(spec) and inspect.isclass(spec.__self__):
        spec = spec.__self__
    return spec if inspect.isclass(spec) else None


def _is_subclass(module: Any, base: type) -> bool:
    return inspect.isclass(module) and issubclass(module, base)


def _describe(spec: Any) -> str:
    """A spec's form for an error message: its type and what it builds."""
    built = getattr(spec, "module", getattr(spec, "func", spec))
    name = getattr(built, "__qualname__", repr(built))
    return f"{type(spec).__qualname__}({name})" if built is not spec else name


def get_gpt_layer_local_spec(*args: Any, **kwargs: Any) -> ModuleSpec:
    """``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`` with prefix
    sharing; same arguments."""
    return with_prefix_sharing(gpt_layer_specs.get_gpt_layer_local_spec(*args, **kwargs))


def get_gpt_layer_with_transformer_engine_spec(*args: Any, **kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_with_transformer_engine_spec`` with prefix sharing; same arguments.

    Needs Transformer Engine; the attention kernel is chosen per micro-batch by the config's
    ``backend`` (flash-attn or TE's own THD attention on CUDA).
    """
    if not gpt_layer_specs.HAVE_TE:
        raise ImportError(
            "get_gpt_layer_with_transformer_engine_spec needs transformer-engine "
            "(pip install 'prefix-sharing[cuda]'); use get_gpt_layer_local_spec without it"
        )
    return with_prefix_sharing(
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(*args, **kwargs)
    )
