"""Patch sets ``verl091_mcore_mindspeed`` and ``verl080_mcore_mindspeed``: verl's MindSpeed engine.

On Ascend verl registers ``MindspeedEngineWithLMHead`` (``verl/workers/engine/mindspeed/
transformer_impl.py``) as the Megatron language-model engine for the ``npu`` device. It
subclasses the stock ``MegatronEngineWithLMHead`` - not the prefix-sharing engine the
``verl*_mcore`` patch sets put in its place - and its ``_init_device_mesh`` calls MindSpeed's
``repatch``, which removes every MindSpeed patch and re-applies MindSpeed's features.

The hook on that module builds ``PrefixSharingMindspeedEngine``: the MindSpeed engine on top of
the prefix-sharing Megatron engine (layer spec, shared forward, metrics), which registers the
``prefix-sharing`` MindSpeed feature (:func:`prefix_sharing.npu.enable_mindspeed`) right before
verl's repatch, so that repatch applies it too. It replaces the MindSpeed engine in verl's
engine registry. verl 0.8.0's separate ``mindspeed_megatron`` backend (models built by
MindSpeed-LLM's own provider) is left alone: it does not build the prefix-sharing spec.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from .patchsets import register_releases

__all__ = ["PATCHSETS"]

TARGET = "verl.workers.engine.mindspeed.transformer_impl"
MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"


def _patch_mindspeed_engine(module: ModuleType) -> None:
    from ..npu import enable_mindspeed
    from .engine import install_engine

    shared = getattr(sys.modules.get(MEGATRON_ENGINE), "PrefixSharingMegatronEngine", None)
    if shared is None:
        raise RuntimeError(
            "the MindSpeed patch set needs the Megatron one (verl*_mcore) applied first; "
            f"{MEGATRON_ENGINE} has no PrefixSharingMegatronEngine"
        )
    stock = module.MindspeedEngineWithLMHead

    class PrefixSharingMindspeedEngine(stock, shared):
        """verl's MindSpeed engine computing each micro-batch's shared prefixes once."""

        def _init_device_mesh(self, *args: Any, **kwargs: Any) -> None:
            if self.prefix_sharing.enabled and module.repatch is not None:
                enable_mindspeed()  # listed before verl's repatch, so the repatch re-applies it
            super()._init_device_mesh(*args, **kwargs)

    install_engine(module, stock, PrefixSharingMindspeedEngine)


PATCHSETS = register_releases(
    "mcore_mindspeed",
    hooks={TARGET: _patch_mindspeed_engine},
    summary="verl {release} MindSpeed engine (Ascend): the prefix-sharing engine under "
            "MindSpeed, its feature re-applied by every repatch",
)
