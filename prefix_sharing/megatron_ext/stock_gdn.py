"""Megatron-core's own Gated DeltaNet: whether this release serves it, and a stock layer of it.

The sharing mixer (:mod:`.gated_delta_net`) subclasses megatron-core 0.19.2's
``GatedDeltaNet``; the spec swap (:mod:`.spec_surgery`), the hybrid stack (:mod:`.hybrid`) and
the engines ask here whether this release has it, and the references build megatron's stock
local GDN layer with :func:`gdn_layer_spec`. A leaf: it imports nothing of the sharing modules.

What a process must do before it builds a GDN layer is registered here
(:func:`before_building_gdn`): a CPU-only process registers its redirections
(:mod:`.cpu_support`), so a GPU process never imports that code.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from ..refusals import REFUSALS


__all__ = ["GDN_NOT_SERVED", "before_building_gdn", "gdn_layer_spec", "prepare_gated_delta_net",
           "serves_gated_delta_net"]

_PREPARATIONS: list[Callable[[], None]] = []


def before_building_gdn(prepare: Callable[[], None]) -> None:
    """Registers ``prepare`` (idempotent) to run before every GDN layer this process builds."""
    if prepare not in _PREPARATIONS:
        _PREPARATIONS.append(prepare)


def prepare_gated_delta_net() -> None:
    """Runs what :func:`before_building_gdn` registered (nothing in a GPU process)."""
    for prepare in _PREPARATIONS:
        prepare()


# Why a Gated DeltaNet layer is refused on a release other than 0.19.2 (a hybrid 'G' layer's
# reason, checks.UNSERVED_HYBRID_LAYERS; the refusal megatron.gdn_release says it where a site
# raises it).
GDN_NOT_SERVED = "Gated DeltaNet: " + REFUSALS["megatron.gdn_release"].reason


def serves_gated_delta_net() -> bool:
    """Whether this megatron-core has 0.19.2's Gated DeltaNet package, the module the sharing
    mixer subclasses (before, ``megatron.core.ssm.gated_delta_net`` is a plain module)."""
    try:
        return importlib.util.find_spec("megatron.core.ssm.gated_delta_net.gdn") is not None
    except ModuleNotFoundError:  # no package of that name: 0.16 - 0.18
        return False


def gdn_layer_spec(norm: Any) -> ModuleSpec:
    """A stock Gated DeltaNet layer of megatron's local (TE-free) modules: ``norm`` (the local
    spec's norm class, which follows ``config.normalization``) before the mixer and on its
    output heads, column- and row-parallel linear layers for its projections. The TE form
    (megatron's ``hybrid_stack_spec``) fuses the input norm into the projection instead."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    prepare_gated_delta_net()  # in a CPU process: fla's Triton l2norm has no CPU driver

    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
    ))
