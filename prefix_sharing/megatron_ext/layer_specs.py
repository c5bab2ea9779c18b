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

import dataclasses
import inspect
from typing import Any, Callable

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                              MultiTokenPredictionLayer)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..refusals import refuse
from .moe import PrefixSharingTransformerLayer
from .mtp import PrefixSharingMTPLayer
from .spec_surgery import (
    UnsupportedSpecError,
    built_class,
    describe,
    is_gated_delta_net,
    is_subclass,
    replaced,
    sharing_attention_layer,
    sharing_gdn_layer,
    sharing_router_mlp,
)

__all__ = [
    "UnsupportedSpecError",
    "with_prefix_sharing",
    "register_spec_form",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
]


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
            :mod:`.hybrid`), a ``MultiTokenPredictionBlockSubmodules`` as
            ``get_gpt_mtp_block_spec`` returns (each MTP layer the sharing one, :mod:`.mtp`, its
            transformer layer shared as above; the model then needs
            :func:`.mtp.share_multi_token_prediction`), or a form added with
            :func:`register_spec_form`.

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
            raise refuse("megatron.spec.form", f"layer_specs={spec.layer_specs!r}",
                         error=UnsupportedSpecError)
        return dataclasses.replace(spec, layer_specs=_sharing_layers(spec.layer_specs))
    if isinstance(spec, list):
        return _sharing_layers(spec)
    if isinstance(spec, MultiTokenPredictionBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[
            _sharing_mtp_layer(layer, f"MTP layer {i + 1}")
            for i, layer in enumerate(spec.layer_specs)])
    raise refuse("megatron.spec.form", f"a spec of type {type(spec).__qualname__}",
                 error=UnsupportedSpecError)


def _sharing_layers(layer_specs: list) -> list:
    return [_sharing_layer(layer, f"layer {i + 1}") for i, layer in enumerate(layer_specs)]


def _sharing_layer(layer_spec: Any, where: str) -> ModuleSpec:
    """The sharing copy of one ``TransformerLayer`` spec (``where`` names it in errors)."""
    if not (isinstance(layer_spec, ModuleSpec)
            and is_subclass(layer_spec.module, TransformerLayer)):
        raise refuse("megatron.spec.layer", f"{where} is {describe(layer_spec)}",
                     error=UnsupportedSpecError)
    if is_gated_delta_net(getattr(layer_spec.submodules.self_attention, "module", None)):
        spec = sharing_gdn_layer(layer_spec, where)
    else:
        spec = sharing_attention_layer(layer_spec, where)
    mlp = spec.submodules.mlp
    target = built_class(mlp)
    if target is None:
        raise refuse("megatron.spec.mlp_form", f"{where} has mlp={describe(mlp)}",
                     error=UnsupportedSpecError)
    if issubclass(target, BaseMoELayer):
        if spec.module not in (TransformerLayer, PrefixSharingTransformerLayer):
            raise refuse("megatron.spec.moe_layer_class",
                         f"{where} is a {spec.module.__qualname__}", error=UnsupportedSpecError)

        spec = replaced(spec, mlp=sharing_router_mlp(mlp, where))
        spec.module = PrefixSharingTransformerLayer
    return spec


def _sharing_mtp_layer(layer_spec: Any, where: str) -> ModuleSpec:
    """The sharing copy of one ``MultiTokenPredictionLayer`` spec: the layer class and its
    transformer layer swapped (an MoE one with the sharing router, which keeps the statistics
    of the depth's plain batch), its norms and projection kept."""
    if not (isinstance(layer_spec, ModuleSpec)
            and is_subclass(layer_spec.module, MultiTokenPredictionLayer)):
        raise refuse("megatron.spec.layer", f"{where} is {describe(layer_spec)}",
                     error=UnsupportedSpecError)
    # the transformer layer's field: transformer_layer up to megatron-core 0.18, then
    # mtp_model_layer (which may also be a hybrid stack: refused by _sharing_layer)
    field = ("transformer_layer" if hasattr(layer_spec.submodules, "transformer_layer")
             else "mtp_model_layer")
    layer = _sharing_layer(getattr(layer_spec.submodules, field), f"{where}'s {field}")
    spec = replaced(layer_spec, **{field: layer})
    spec.module = PrefixSharingMTPLayer
    return spec


def _builds_hybrid_stack(spec: ModuleSpec) -> bool:
    """Whether ``spec`` builds megatron-core 0.18+'s ``HybridStack`` (told without importing
    :mod:`.hybrid`, which older releases cannot)."""
    return inspect.isclass(spec.module) and any(
        cls.__name__ == "HybridStack" and cls.__module__.startswith("megatron.core.models.hybrid")
        for cls in spec.module.__mro__)


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
