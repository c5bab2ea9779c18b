"""The layer spec for Megatron-LM's command line::

    pretrain_gpt.py ... --spec prefix_sharing.megatron_ext.megatron_lm_spec layer_spec

Megatron-LM imports the object that ``--spec <module> <name>`` names (in its model provider up to
core_r0.16.0, in ``gpt_config_from_args`` from megatron-core 0.17's bundled ``megatron.training``;
both after its arguments are parsed) and builds ``GPTModel`` with it. So ``layer_spec`` is built
when this module is first imported: the spec Megatron-LM would build by default for those
arguments - Transformer Engine or local, MoE, qk-layernorm / qk-l2-norm, normalization, the
Transformer Engine builder's options - with prefix sharing. Arguments the sharing spec cannot
honour are refused here, each by name, rather than trained on a model the command line did not
ask for.

Whether this is a Megatron-LM run is read from Megatron-LM's own state - its parsed arguments in
``megatron.training.global_vars`` - not from whether ``megatron.training`` imports: megatron-core
0.17+ ships ``megatron.training`` inside its wheel, so it imports everywhere. Without parsed
arguments (megatron-core used as a library, as in this package's tests) ``layer_spec`` is the
default local spec, since there are no arguments it could follow.
"""

from __future__ import annotations

import inspect
import sys
from argparse import Namespace
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

from ..refusals import refuse
from .checks import UnsupportedSetupError
from .layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec

__all__ = ["layer_spec", "megatron_lm_args", "layer_spec_for"]

# argument -> its value when unset: Megatron-LM settings that build a different model than this
# spec would (another core attention, another layer per block, another builder)
_REFUSED = {
    "experimental_attention_variant": None,  # its block spec replaces the attention module
    "heterogeneous_layers_config_path": None,  # per-layer specs from a config file
    "restore_modelopt_state": False,  # ModelOpt's own spec
    "use_kitchen_attention": False,  # Kitchen's core attention instead of the sharing one
}

# options of megatron-core's spec builders that Megatron-LM passes, by argument name
_BUILDER_OPTIONS = {
    "qk_l2_norm": "qk_l2_norm",
    "use_transformer_engine_op_fuser": "use_te_op_fuser",
    "use_kitchen": "use_kitchen",
    "kitchen_attention_backend": "kitchen_attention_backend",
    "use_te_activation_func": "use_te_activation_func",
    "mla_down_proj_fusion": "mla_down_proj_fusion",
    "use_grouped_gemm_for_dense_mlp": "use_grouped_gemm_for_dense_mlp",
}


def megatron_lm_args() -> Namespace | None:
    """Megatron-LM's parsed arguments, or None when no Megatron-LM run has parsed any.

    Read from ``megatron.training.global_vars`` only if something already imported it: a
    Megatron-LM run has, before it parses its arguments.
    """
    global_vars = sys.modules.get("megatron.training.global_vars")
    return None if global_vars is None else getattr(global_vars, "_GLOBAL_ARGS", None)


def layer_spec_for(args: Namespace | None) -> ModuleSpec:
    """The sharing layer spec for Megatron-LM's arguments (the default local spec for None).

    Mirrors Megatron-LM's default layer-spec choice (``gpt_builders`` / ``GPTModelBuilder``).

    Raises:
        UnsupportedSetupError: an argument the sharing spec cannot honour, named.
    """
    if args is None:
        return get_gpt_layer_local_spec()
    _refuse(args)
    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("transformer_engine", "local"):
        raise refuse("megatron_lm.transformer_impl", f"--transformer-impl {impl}",
                     error=UnsupportedSetupError)
    builder = (get_gpt_layer_with_transformer_engine_spec if impl == "transformer_engine"
               else get_gpt_layer_local_spec)
    options: dict[str, Any] = dict(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
    )
    if impl == "local":
        options["normalization"] = args.normalization
    options.update(_builder_options(args, impl))
    return builder(**options)


def _refuse(args: Namespace) -> None:
    for name, unset in _REFUSED.items():
        value = getattr(args, name, unset)
        if value not in (unset, None, False, 0):
            raise refuse("megatron_lm.model_argument", f"--{name.replace('_', '-')} {value}",
                         error=UnsupportedSetupError)
    if str(getattr(args, "attention_backend", "")).endswith("local"):
        raise refuse("megatron_lm.attention_backend_local", error=UnsupportedSetupError)
    freq = getattr(args, "moe_layer_freq", 1)
    every_layer = freq == 1 or (isinstance(freq, list) and all(f == 1 for f in freq))
    if args.num_experts and not every_layer:
        raise refuse("megatron_lm.moe_layer_freq", f"--moe-layer-freq {freq}",
                     error=UnsupportedSetupError)


def _builder_options(args: Namespace, impl: str) -> dict[str, Any]:
    """Builder options Megatron-LM sets: forwarded where megatron-core's builder takes them,
    refused by name where it does not (an older release) and the argument asks for them."""
    from megatron.core.models.gpt import gpt_layer_specs

    stock = gpt_layer_specs.get_gpt_layer_local_spec
    if impl == "transformer_engine":
        stock = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    accepted = inspect.signature(stock).parameters
    options = {}
    for arg, option in _BUILDER_OPTIONS.items():
        if not hasattr(args, arg):
            continue
        value = getattr(args, arg)
        if option in accepted:
            options[option] = value
        elif value and option != "kitchen_attention_backend":
            raise refuse("megatron_lm.builder_option",
                         f"--{arg.replace('_', '-')}: megatron-core's {stock.__name__} has no "
                         f"{option} option", error=UnsupportedSetupError)

    return options


layer_spec: ModuleSpec = layer_spec_for(megatron_lm_args())
