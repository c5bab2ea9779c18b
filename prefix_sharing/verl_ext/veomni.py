"""verl's VeOmni engines (``model_engine=veomni``) refuse sharing by name, never run unshared.

VeOmni (``verl/workers/engine/veomni/``) builds and parallelizes the model itself
(``build_foundation_model``, ``build_parallelize_model``: its own attention dispatch, Ulysses
and kernels) and feeds it its own flash-attention keywords; none of the hooks that make verl's
FSDP engine share (the sharing attention switched in after the model is built, the plan's
inputs, the hidden-state head) reach that path. Serving it would need VeOmni's attention
dispatch to take the sharing attention; until then a run that asks for sharing on VeOmni is
refused with the one-line change (``model_engine=fsdp``) rather than silently computing every
shared prefix.

- :class:`VeOmniRefusal` goes first in the bases of each VeOmni engine when verl imports its
  module (:func:`patch_engine`, a hook of the FSDP patch sets, :mod:`.fsdp`): its ``__init__``
  raises what :meth:`VeOmniRefusal.setup_problems` finds, and
  ``prefix-sharing preflight`` asks the same classmethod (:mod:`.preflight`), whether or not the
  ``veomni`` package is installed where preflight runs;
- the VeOmni actor and critic config classes accept ``prefix_grouper`` like the FSDP ones
  (:mod:`.config`), so that the request reaches the engine config this refusal reads.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import PrefixSharingSetupError
from ..refusals import Refused, refuse_all
from .config import sharing_config
from .engine import install_engine

__all__ = ["VeOmniRefusal", "patch_engine", "ENGINE_MODULE"]

ENGINE_MODULE = "verl.workers.engine.veomni.transformer_impl"
ENGINES = ("VeOmniEngineWithLMHead", "VeOmniEngineWithValueHead")


class VeOmniRefusal:
    """Refuses construction of a VeOmni engine whose config asks for sharing."""

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        found = self.setup_problems(model_config, engine_config)
        if found:
            raise refuse_all(found, error=PrefixSharingSetupError)
        super().__init__(model_config, engine_config, *args, **kwargs)

    @classmethod
    def setup_problems(cls, model_config: Any, engine_config: Any) -> list[Refused]:
        """``verl.veomni`` when the engine config carries a sharing request, else nothing."""
        if not sharing_config(engine_config).enabled:
            return []
        return [Refused("verl.veomni", "model_engine=veomni (strategy veomni)")]


def patch_engine(module: ModuleType) -> None:
    """Hook on ``verl.workers.engine.veomni.transformer_impl``: each VeOmni engine verl
    registers is replaced, where the registry selects it, by a subclass that refuses sharing."""
    for name in ENGINES:
        stock = getattr(module, name, None)
        if stock is not None and not issubclass(stock, VeOmniRefusal):
            refusing = type(f"PrefixSharingRefused{name}", (VeOmniRefusal, stock),
                            {"__doc__": f"verl's ``{name}``, refusing prefix sharing."})
            install_engine(module, stock, refusing)
