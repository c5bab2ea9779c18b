"""The layer spec for Megatron-LM's command line::

    pretrain_gpt.py ... --spec prefix_sharing.megatron_ext.megatron_lm_spec layer_spec

Megatron-LM imports the object that ``--spec <module> <name>`` names and hands it to
``GPTModel`` as its layer spec, so ``layer_spec`` is built when this module is first imported
(inside Megatron-LM's model provider, after its arguments are parsed). It is the spec Megatron-LM
would build by default for those arguments - Transformer Engine or local, MoE, qk-layernorm,
normalization - with prefix sharing.

Where Megatron-LM is not installed at all (``megatron.training`` does not exist: megatron-core
alone, as in this package's tests) it is the default local spec, since there are no arguments
it could follow. Where Megatron-LM is installed but has not parsed its arguments yet, the import
fails: a spec silently built for the wrong model (local instead of Transformer Engine, no MoE)
would train something else than the command line asks for.
"""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from .layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec

__all__ = ["layer_spec"]


def _megatron_lm_args():
    """Megatron-LM's parsed arguments; None when Megatron-LM is not installed."""
    try:
        from megatron.training import get_args
    except ModuleNotFoundError as error:
        if error.name in ("megatron.training", "megatron"):
            return None
        raise  # Megatron-LM is there but broken: its own error says why
    try:
        return get_args()
    except AssertionError as error:  # megatron.training's "args is not initialized."
        raise RuntimeError(
            "prefix_sharing.megatron_ext.megatron_lm_spec was imported before Megatron-LM parsed "
            "its arguments, so it cannot tell which layer spec they ask for; pass it as "
            "--spec prefix_sharing.megatron_ext.megatron_lm_spec layer_spec (Megatron-LM imports "
            "it in its model provider), or build a spec with "
            "prefix_sharing.megatron_ext.get_gpt_layer_local_spec / "
            "get_gpt_layer_with_transformer_engine_spec"
        ) from error


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
