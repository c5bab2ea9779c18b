"""``HybridModel`` stacks with prefix sharing: megatron-core's pattern-built successor of GPTModel.

megatron-core 0.18 added ``models/hybrid/``: a ``HybridModel`` whose decoder, a ``HybridStack``,
builds one layer per symbol of a pattern such as ``"*-*E"`` from the matching slot of a
``HybridStackSubmodules`` spec (``*`` attention, ``-`` MLP, ``E`` mixture of experts, ``M``
Mamba, ``G`` Gated DeltaNet, ``D`` DeepSeek sparse attention, ``+`` multi-latent attention; a
``/`` appends multi-token-prediction depths). ``HybridModel.forward`` hands ``packed_seq_params``
(and so the plan) to every layer on every pipeline stage, as ``GPTModel`` does, so the sharing
layers need no new plumbing; only the stack spec changes:

- :func:`with_prefix_sharing` swaps, in a stock or local stack spec, the attention slot's
  self-attention and core attention, the Gated DeltaNet slot's mixer (megatron-core 0.19.2:
  the state carried across shared prefixes, see :mod:`.gated_delta_net`), and the MoE slot's
  layer class and router (the layer hands the plan to its router, whose batch statistics then
  count the plain batch, see :mod:`.moe`). MLP layers are per token and stay stock. Slots the
  sharing layers cannot serve (Mamba carries a state that megatron's Mamba kernels cannot start
  from a provider's; MLA and DSA have their own attention; GDN before 0.19.2) are replaced by a
  spec that raises when a pattern actually builds one: a stock spec fills every slot, and a
  model without those symbols must still build. Why, per symbol, is
  :func:`~.checks.hybrid_layer_problem`, which ``preflight`` reads a pattern with
  (:func:`~.checks.hybrid_pattern_problems`).
- :func:`get_hybrid_stack_local_spec` is the stack spec without Transformer Engine (the stock
  ``hybrid_stack_spec`` is built from TE classes, and ``HybridStack`` hard-codes a TE final
  norm): megatron's own local GPT layer parts, split into the attention, MLP and MoE slots,
  and megatron's ``GatedDeltaNet`` with local linear layers and norm in the GDN slot.

Importing this module needs a megatron-core with ``models/hybrid`` (0.18 or later); the package
``prefix_sharing.megatron_ext`` does not import it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any

if importlib.util.find_spec("megatron.core.models.hybrid") is None:
    raise ImportError(
        "prefix_sharing.megatron_ext.hybrid needs megatron-core's HybridModel "
        "(megatron.core.models.hybrid, megatron-core >= 0.18 on Python >= 3.12)"
    )

import torch  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.models.hybrid.hybrid_block import (  # noqa: E402
    HybridStack,
    HybridStackSubmodules,
)
from megatron.core.ssm.mlp_layer import MLPLayer  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.multi_token_prediction import (  # noqa: E402
    MultiTokenPredictionBlock,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # noqa: E402
from megatron.core.transformer.transformer_layer import (  # noqa: E402
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from ..refusals import refuse_all  # noqa: E402
from .checks import UnsupportedSetupError, hybrid_layer_problem  # noqa: E402
from .spec_surgery import (  # noqa: E402
    replaced,
    sharing_attention_layer,
    sharing_gdn_layer,
    sharing_router_mlp,
)
from .stock_gdn import gdn_layer_spec, serves_gated_delta_net  # noqa: E402
from .moe import PrefixSharingTransformerLayer  # noqa: E402

__all__ = [
    "LocalHybridStack",
    "PrefixSharingMoETransformerLayer",
    "get_hybrid_stack_local_spec",
    "with_prefix_sharing",
]

# The HybridStackSubmodules slots and their pattern symbols (hybrid_layer_allocation.Symbols).
SLOT_SYMBOLS = {
    "attention_layer": "*",
    "mlp_layer": "-",
    "moe_layer": "E",
    "mamba_layer": "M",
    "gdn_layer": "G",
    "dsa_layer": "D",
    "mla_layer": "+",
}
class PrefixSharingMoETransformerLayer(PrefixSharingTransformerLayer, MoETransformerLayer):
    """The hybrid stack's MoE layer (``MoETransformerLayer``) that hands the plan to its router.

    Its MoE ordinal is not ``moe_layer_freq``'s (the pattern decides), so it does not name a
    column of replayed routes: routing replay under sharing is refused here, by the router."""

    def _moe_layer_index(self) -> int | None:
        return None


class UnsupportedHybridLayer(torch.nn.Module):
    """Stands in a slot sharing cannot serve: building it raises, naming the pattern symbol and
    why (:func:`~.checks.hybrid_layer_problem`, which ``preflight`` reads a pattern with)."""

    def __init__(self, *args: Any, symbol: str, **kwargs: Any) -> None:
        raise refuse_all([hybrid_layer_problem(symbol)], error=UnsupportedSetupError)



def with_prefix_sharing(stack_spec: ModuleSpec) -> ModuleSpec:
    """A copy of a ``HybridStack`` spec whose attention and MoE layers share prefixes.

    Args:
        stack_spec: a ``ModuleSpec`` of a ``HybridStack`` (megatron's ``hybrid_stack_spec``,
            :func:`get_hybrid_stack_local_spec`, or your own) with ``HybridStackSubmodules``.

    Returns:
        The copy: in ``attention_layer`` the sharing self-attention and core attention; in
        ``gdn_layer`` the sharing Gated DeltaNet (megatron-core 0.19.2); in ``moe_layer`` the
        sharing layer class and router; ``mlp_layer`` unchanged; every other filled slot
        (``M``, ``D``, ``+``, ``G`` on other releases, and multi-token prediction) a spec that
        raises :class:`~.checks.UnsupportedSetupError` naming its symbol when a pattern builds it.

    Raises:
        ValueError: for a stack, attention or MoE layer spec in a form it does not recognise
            (naming the slot's symbol and the form found).
    """
    if not (isinstance(stack_spec, ModuleSpec) and isinstance(stack_spec.module, type)
            and issubclass(stack_spec.module, HybridStack)
            and isinstance(stack_spec.submodules, HybridStackSubmodules)):
        raise ValueError(
            "hybrid.with_prefix_sharing needs a ModuleSpec of a HybridStack with "
            f"HybridStackSubmodules; got {_form(stack_spec)}"
        )
    spec = replaced(stack_spec)
    slots = spec.submodules
    for field in dataclasses.fields(slots):
        value = getattr(slots, field.name)
        if field.name == "mtp_block_spec":
            setattr(slots, field.name, _refuse_mtp(value))
        elif value is IdentityOp:
            continue  # an unused slot
        elif field.name in ("mlp_layer", "attention_layer") and _is_moe(
                getattr(getattr(value, "submodules", None), "mlp", None)):
            raise ValueError(f"hybrid layer {SLOT_SYMBOLS[field.name]!r} has an MoE mlp, whose "
                             "router would count the flat rows; put MoE in moe_layer ('E')")
        elif field.name == "mlp_layer":
            continue  # per token: exact as it is
        elif field.name == "attention_layer":
            setattr(slots, field.name, sharing_attention_layer(
                value, f"hybrid layer {SLOT_SYMBOLS[field.name]!r}"))
        elif field.name == "moe_layer":
            setattr(slots, field.name, _share_moe(value, SLOT_SYMBOLS[field.name]))
        elif field.name == "gdn_layer" and serves_gated_delta_net():
            setattr(slots, field.name, sharing_gdn_layer(value, "hybrid layer 'G'"))
        else:  # known not-yet slots, and slots of a later megatron-core this does not know
            setattr(slots, field.name, ModuleSpec(
                module=UnsupportedHybridLayer,
                params={"symbol": SLOT_SYMBOLS.get(field.name, field.name)}))
    return spec


def _share_moe(layer: Any, symbol: str) -> ModuleSpec:
    """The MoE layer whose class hands the plan to a sharing router."""
    sharing_layers = {MoETransformerLayer: PrefixSharingMoETransformerLayer,
                      TransformerLayer: PrefixSharingTransformerLayer}
    if not (isinstance(layer, ModuleSpec) and layer.module in sharing_layers
            and isinstance(layer.submodules, TransformerLayerSubmodules)):
        raise ValueError(
            f"hybrid layer {symbol!r} must be a ModuleSpec of a TransformerLayer or "
            f"MoETransformerLayer with TransformerLayerSubmodules; got {_form(layer)}"
        )
    if not _is_moe(layer.submodules.mlp):
        raise ValueError(f"hybrid layer {symbol!r}: its mlp must be megatron's MoELayer, as a "
                         f"ModuleSpec or a functools.partial; got {_form(layer.submodules.mlp)}")
    module = sharing_layers[layer.module]
    if layer.submodules.self_attention is not IdentityOp:
        layer = sharing_attention_layer(layer, f"hybrid layer {symbol!r}")
    layer = replaced(layer, mlp=sharing_router_mlp(layer.submodules.mlp, f"hybrid layer {symbol!r}"))
    layer.module = module
    return layer


def _is_moe(mlp: Any) -> bool:
    """Whether a layer's mlp builder is megatron's MoELayer (a ModuleSpec or a partial)."""
    if isinstance(mlp, functools.partial):
        return mlp.func is MoELayer
    return isinstance(mlp, ModuleSpec) and mlp.module is MoELayer


def _refuse_mtp(block: Any) -> Any:
    """Multi-token prediction reads each sequence's next tokens, which a shared prefix row does
    not have: its layers are replaced by a spec that raises when built."""
    if block is None:
        return None
    if not (isinstance(block, ModuleSpec) and isinstance(block.module, type)
            and issubclass(block.module, MultiTokenPredictionBlock)):
        raise ValueError(f"mtp_block_spec must be a ModuleSpec of a MultiTokenPredictionBlock; "
                         f"got {_form(block)}")
    refusal = ModuleSpec(module=UnsupportedHybridLayer, params={"symbol": "/"})
    return replaced(block, layer_specs=[refusal] * len(block.submodules.layer_specs))


def _form(value: Any) -> str:
    """How a spec entry looks, for an error message."""
    if isinstance(value, ModuleSpec):
        return f"ModuleSpec(module={getattr(value.module, '__name__', value.module)!s})"
    if isinstance(value, functools.partial):
        return f"functools.partial({getattr(value.func, '__name__', value.func)!s})"
    return getattr(value, "__name__", repr(value))


class LocalHybridStack(HybridStack):
    """``HybridStack`` whose final norm is a local (TE-free) norm.

    megatron-core builds the stack's final norm as ``TENorm`` whatever the spec says; this builds
    ``final_norm`` instead (same parameter name ``final_norm.weight``, same math).
    """

    def __init__(self, config: Any, submodules: HybridStackSubmodules, *args: Any,
                 final_norm: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(final_norm, config=config,
                                           hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)


def get_hybrid_stack_local_spec(
    normalization: str = "LayerNorm",
    qk_layernorm: bool = False,
    moe_grouped_gemm: bool = False,
) -> ModuleSpec:
    """A ``HybridStack`` spec of megatron-core's local (TE-free) modules, stock (no sharing).

    The attention (``*``), MLP (``-``) and MoE (``E``) slots are the parts of megatron's
    ``get_gpt_layer_local_spec``: a layer of one of them computes what a GPT layer's matching
    half computes. The Gated DeltaNet slot (``G``) is megatron's ``GatedDeltaNet`` with local
    linear layers and norms (:func:`~.stock_gdn.gdn_layer_spec`; building it needs
    flash-linear-attention installed, as megatron's module asks). Mamba and the MLA slots stay
    empty (megatron has no local Mamba mixer or MLA core attention).
    Wrap it in :func:`with_prefix_sharing` for the sharing model.

    Args:
        normalization: ``"LayerNorm"`` or ``"RMSNorm"`` (the config must say the same).
        qk_layernorm: norms on queries and keys.
        moe_grouped_gemm: grouped experts (needs a GPU); sequential experts otherwise.
    """
    dense = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization,
                                                     qk_layernorm=qk_layernorm).submodules
    attention = TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
        self_attn_bda=dense.self_attn_bda)
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)
    # the experts' count comes from the config; megatron's builder only asks that it is set
    moe = dataclasses.replace(mlp, mlp=get_moe_module_spec(use_te=False, num_experts=1,
                                                           moe_grouped_gemm=moe_grouped_gemm))
    return ModuleSpec(
        module=LocalHybridStack,
        params={"final_norm": dense.input_layernorm},
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
            moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=moe),
            gdn_layer=gdn_layer_spec(dense.input_layernorm),
        ),
    )
