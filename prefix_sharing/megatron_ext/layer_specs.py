"""GPT layer specs with prefix sharing: megatron-core's own specs, two submodules swapped.

Composition the megatron-core way: take the stock layer spec, copy it, replace
``self_attention.module`` (absolute rotary positions) and
``self_attention.submodules.core_attention`` (K/V injection), keep everything else - norms,
linear layers, MLP or MoE, TE or local flavour. In an MoE layer the router and the layer class
are swapped too, so the router's batch statistics count the plain batch (see :mod:`.moe`).
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from .core_attention import PrefixSharingCoreAttention
from .moe import PrefixSharingRouter, PrefixSharingTransformerLayer
from .self_attention import PrefixSharingSelfAttention

__all__ = [
    "with_prefix_sharing",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_spec",
]


def with_prefix_sharing(layer_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a GPT ``TransformerLayer`` spec whose self-attention shares prefixes.

    Args:
        layer_spec: a layer spec whose ``submodules.self_attention`` is a ``SelfAttention``
            spec (any stock GPT layer spec, local or Transformer Engine, dense or MoE).
    """
    attention = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    if not (isinstance(attention, ModuleSpec) and isinstance(attention.module, type)
            and issubclass(attention.module, SelfAttention)):
        found = getattr(attention, "module", attention)
        raise ValueError(
            "with_prefix_sharing needs a GPT layer spec whose self_attention is a SelfAttention "
            f"ModuleSpec; got self_attention={found!r} (multi-latent attention is not supported)"
        )
    spec = copy.deepcopy(layer_spec)
    spec.submodules.self_attention.module = PrefixSharingSelfAttention
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=PrefixSharingCoreAttention
    )
    mlp = spec.submodules.mlp
    is_moe = isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) \
        and issubclass(mlp.module, MoELayer)
    if is_moe:
        if spec.module is not TransformerLayer:
            raise ValueError(
                f"with_prefix_sharing supports MoE in a plain TransformerLayer; got {spec.module!r}"
            )
        spec.module = PrefixSharingTransformerLayer
        mlp.submodules.router = PrefixSharingRouter
    return spec


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
