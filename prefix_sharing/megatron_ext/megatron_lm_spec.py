"""The layer spec for Megatron-LM's command line::

    pretrain_gpt.py ... --spec prefix_sharing.megatron_ext.megatron_lm_spec layer_spec

Megatron-LM imports the object that ``--spec <module> <name>`` names and hands it to
``GPTModel`` as its layer spec, so ``layer_spec`` is built when this module is first imported
(inside Megatron-LM's model provider, after its arguments are parsed). It is the spec Megatron-LM
would build by default for those arguments - Transformer Engine or local, MoE, qk-layernorm,
normalization - with prefix sharing. Outside Megatron-LM it is the default local spec.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from .layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec

__all__ = ["layer_spec"]


def _megatron_lm_args():
    try:
        from megatron.training import get_args

        return get_args()
    except (ImportError, AssertionError):  # not inside Megatron-LM, or before its arguments
        return None


def _layer_spec_for(args) -> ModuleSpec:
    """Mirrors Megatron-LM's ``gpt_builders._get_transformer_layer_spec`` for ``args``."""
    if args is None:
        return get_gpt_layer_local_spec()
    common = dict(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
    )
    if args.transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(**common)
    return get_gpt_layer_local_spec(**common, normalization=args.normalization)


layer_spec: ModuleSpec = _layer_spec_for(_megatron_lm_args())
