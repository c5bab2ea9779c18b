"""Patch set ``verl080_mcore``: prefix sharing in verl 0.8.0's Megatron engine.

verl 0.8.0 is the release where PrefixGrouper lives (``use_prefix_grouper`` in the actor
config, wired to its legacy FSDP actor only); this set extends it to the Megatron engine. The
engine has the same seams as 0.9.1's, so the hooks are the same (:mod:`.mcore_engine`):

- ``verl.workers.config.actor``: ``McoreActorConfig`` accepts ``prefix_grouper`` (:mod:`.config`);
- ``verl.models.mcore``: ``get_mcore_engine_forward_fn`` returns the shared forward while a
  sharing engine runs a micro-batch (0.8.0 calls it as 0.9.1 does, at call time, same arguments);
- ``verl.workers.engine.megatron.transformer_impl``: the registered language-model engine gains
  the prefix-sharing layer spec, forward and metrics;
- ``verl.workers.engine.utils``: the dynamic-batch-size split keeps sharing groups together
  (:mod:`.microbatch`).

What differs from 0.9.1: 0.8.0 defaults to the vanilla mbridge (``megatron.vanilla_mbridge=True``),
which builds its TE layer spec lazily inside ``bridge.get_model``; the engine replaces this
instance's ``bridge._get_transformer_layer_spec`` right after ``_build_tf_config``, so only the
engines with sharing on (the actor, and the reference model when its config asks) get the
shared spec.
"""

from __future__ import annotations

from .config import accept_prefix_grouper
from .mcore_engine import patch_engine, patch_forward_fn_lookup
from .microbatch import patch_prepare_micro_batches
from .patchsets import PatchSet, register

__all__ = ["PATCHSET"]

PATCHSET = register(PatchSet(
    name="verl080_mcore",
    verl_versions=("0.8.0",),
    hooks={
        "verl.workers.config.actor": lambda m: accept_prefix_grouper(m, "McoreActorConfig"),
        "verl.models.mcore": patch_forward_fn_lookup,
        "verl.workers.engine.megatron.transformer_impl": patch_engine,
        "verl.workers.engine.utils": patch_prepare_micro_batches,
    },
    summary="verl 0.8.0 Megatron engine: actor config, layer spec (mbridge), forward, "
            "group-keeping micro-batches, metrics",
))
