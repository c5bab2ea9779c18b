"""Patch set ``verl091_mcore``: prefix sharing in verl 0.9.1's Megatron engine.

Hooks (each runs when verl imports the module; the glue is :mod:`.mcore_engine`'s):

- ``verl.workers.config.actor``: ``McoreActorConfig`` accepts ``prefix_grouper`` and hands the
  validated config to its engine config (:mod:`.config`);
- ``verl.models.mcore``: ``get_mcore_engine_forward_fn`` returns :func:`.mcore.shared_forward`
  while a sharing engine runs a micro-batch, verl's own forward otherwise;
- ``verl.workers.engine.megatron.transformer_impl``: the registered language-model engine
  becomes ``PrefixSharingMegatronEngine`` for every device it was registered for;
- ``verl.workers.engine.utils``: the dynamic-batch-size split keeps sharing groups together
  (:mod:`.microbatch`).

What is particular to 0.9.1: Megatron-Bridge is the default bridge; the sharing engine sets the
layer spec on its ``provider.transformer_layer_spec`` (a spec, or a factory whose signature
Megatron-Bridge inspects), where verl itself sets it for QAT. The deprecated vanilla mbridge
(``megatron.vanilla_mbridge=True``) is hooked as in 0.8.0.
"""

from __future__ import annotations

from .config import accept_prefix_grouper
from .mcore_engine import patch_engine, patch_forward_fn_lookup
from .microbatch import patch_prepare_micro_batches
from .patchsets import PatchSet, register

__all__ = ["PATCHSET"]

PATCHSET = register(PatchSet(
    name="verl091_mcore",
    verl_versions=("0.9.1",),
    hooks={
        "verl.workers.config.actor": lambda m: accept_prefix_grouper(m, "McoreActorConfig"),
        "verl.models.mcore": patch_forward_fn_lookup,
        "verl.workers.engine.megatron.transformer_impl": patch_engine,
        "verl.workers.engine.utils": patch_prepare_micro_batches,
    },
    summary="verl 0.9.1 Megatron engine: actor config, layer spec, forward, "
            "group-keeping micro-batches, metrics",
))
