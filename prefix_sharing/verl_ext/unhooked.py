"""verl's engines prefix sharing does not hook refuse sharing by name, never run unshared.

verl registers engines beyond the FSDP and Megatron ones this project patches: VeOmni
(``model_engine=veomni``), AutoModel (the SFT trainer's ``engine=automodel``, NeMo AutoModel) and
TorchTitan (``model_engine=torchtitan``). Each builds and parallelizes the model itself (its own
attention dispatch, sequence parallelism and kernels) and feeds it its own attention keywords;
none of the hooks that make verl's FSDP engine share (the sharing attention switched in after
the model is built, the plan's inputs, the hidden-state head) reach that path. A run that asks
for sharing on one of them is refused with the one-line change rather than silently computing
every shared prefix - one mechanism, one row of :data:`UNHOOKED` per engine:

- :class:`UnhookedRefusal` goes first in the bases of each of the engine's classes when verl
  imports its module (:func:`patch_engine`, hooks of the FSDP patch sets, :mod:`.fsdp`): its
  ``__init__`` raises what :meth:`UnhookedRefusal.setup_problems` finds, and
  ``prefix-sharing preflight`` asks the same classmethod (:func:`refusal_for`, :mod:`.preflight`),
  whether or not the engine's own package (``veomni``, ``nemo_automodel``, ``torchtitan``) is
  installed where preflight runs;
- the engines' actor, critic and engine config classes accept ``prefix_grouper`` like the FSDP
  ones (:data:`ACTOR_CONFIGS`, :data:`CRITIC_CONFIGS`, :data:`ENGINE_CONFIGS`, :mod:`.config`),
  so that the request reaches the engine config this refusal reads.

One refusal key, ``verl.unhooked_engine``, the engine named in the setting it reports.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from types import ModuleType
from typing import Any

from ..errors import PrefixSharingSetupError
from ..refusals import Refused, refuse_all
from .config import sharing_config
from .engine import install_engine

__all__ = ["UNHOOKED", "Unhooked", "UnhookedRefusal", "patch_engine", "refusal_for",
           "engine_hooks", "ACTOR_CONFIGS", "CRITIC_CONFIGS", "ENGINE_CONFIGS"]


@dataclasses.dataclass(frozen=True)
class Unhooked:
    """One engine verl registers that prefix sharing does not hook: its verl module, the
    engine classes it registers and the setting the refusal names."""

    module: str
    engines: tuple[str, ...]
    setting: str


# verl's backend name -> the engine (verl 0.9.1's registrations, verl/workers/engine/)
UNHOOKED = {
    "veomni": Unhooked("verl.workers.engine.veomni.transformer_impl",
                       ("VeOmniEngineWithLMHead", "VeOmniEngineWithValueHead"),
                       "model_engine=veomni (strategy veomni)"),
    "automodel": Unhooked("verl.workers.engine.automodel.transformer_impl",
                          ("AutomodelEngineWithLMHead",),
                          "engine=automodel (strategy automodel: NeMo AutoModel)"),
    "torchtitan": Unhooked("verl.workers.engine.torchtitan.transformer_impl",
                           ("TorchTitanEngineWithLMHead",),
                           "model_engine=torchtitan (strategy torchtitan)"),
}
# their config classes, which accept the sharing keys so that the request reaches the refusal
ACTOR_CONFIGS = ("VeOmniActorConfig", "TorchTitanActorConfig")
CRITIC_CONFIGS = ("VeOmniCriticConfig", "TorchTitanCriticConfig")
ENGINE_CONFIGS = ("VeOmniEngineConfig", "AutomodelEngineConfig", "TorchtitanEngineConfig")


class UnhookedRefusal:
    """Refuses construction of an unhooked engine whose config asks for sharing (a subclass
    per engine sets :attr:`unhooked`)."""

    unhooked: Unhooked

    def __init__(self, model_config: Any, engine_config: Any, *args: Any, **kwargs: Any) -> None:
        found = self.setup_problems(model_config, engine_config)
        if found:
            raise refuse_all(found, error=PrefixSharingSetupError)
        super().__init__(model_config, engine_config, *args, **kwargs)

    @classmethod
    def setup_problems(cls, model_config: Any, engine_config: Any) -> list[Refused]:
        """The refusal, naming the engine, when the engine config carries a sharing request,
        else nothing."""
        if not sharing_config(engine_config).enabled:
            return []
        return [Refused("verl.unhooked_engine", cls.unhooked.setting)]


def refusal_for(backend: str) -> type[UnhookedRefusal] | None:
    """The refusing class of verl's ``backend`` (what its engines check at construction), or
    None when the backend is not in :data:`UNHOOKED`."""
    unhooked = UNHOOKED.get(backend)
    if unhooked is None:
        return None
    return type(f"{backend}Refusal", (UnhookedRefusal,), {"unhooked": unhooked})


def patch_engine(module: ModuleType, backend: str) -> None:
    """Hook on the module of ``backend``'s engines: each engine verl registers there is
    replaced, where the registry selects it, by a subclass that refuses sharing."""
    refusal = refusal_for(backend)
    for name in UNHOOKED[backend].engines:
        stock = getattr(module, name, None)
        if stock is not None and not issubclass(stock, UnhookedRefusal):
            refusing = type(f"PrefixSharingRefused{name}", (refusal, stock),
                            {"__doc__": f"verl's ``{name}``, refusing prefix sharing."})
            install_engine(module, stock, refusing)


def engine_hooks() -> dict:
    """The patch set's hooks: each unhooked engine's module -> :func:`patch_engine`."""
    return {unhooked.module: partial(patch_engine, backend=backend)
            for backend, unhooked in UNHOOKED.items()}
