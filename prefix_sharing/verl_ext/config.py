"""The ``prefix_grouper`` block in verl's actor and critic configs, and its way to the engine.

verl converts the actor section into a strict dataclass (``McoreActorConfig`` in 0.9.1) that
rejects unknown keys, so :func:`accept_prefix_grouper` replaces that class, in its module, by a
subclass with a ``prefix_grouper`` field. The subclass validates the block through
:meth:`PrefixSharingConfig.from_verl` when verl builds it (a typo fails the run at start-up, in
the worker that reads it), and attaches the result to the engine config
(``actor_config.engine``): verl builds the engine from the engine config alone, so that is the
only object the engine's forward can read it from (:func:`sharing_config`).

The reference model reads the ``ref`` section, which has no ``prefix_grouper`` of its own: the
overlays in ``configs/verl/`` point it at the actor's. The critic's config classes
(``FSDPCriticConfig``, ``McoreCriticConfig``) have no ``use_prefix_grouper`` either: the same
replacement adds both keys (``critic.use_prefix_grouper``, ``critic.prefix_grouper``, given with
hydra's ``+`` as they are not in verl's defaults) and hands them to the critic's engine config.

verl's SFT trainer has no role section: it converts its ``engine`` section straight into the
engine config (``FSDPEngineConfig`` / ``McoreEngineConfig``) and builds the engine from it, so
there the same keys sit in the engine section (``engine.use_prefix_grouper``,
``engine.prefix_grouper``) and the engine-config class accepts them (``section=None``). An
actor's engine config that asked for sharing itself keeps its own; an actor section asking for
a different one is an error.

With ``ENABLE_PREFIX_SHARING=0`` the subclass is installed with ``enabled=False``: the block is
still accepted and validated (the same config runs with the switch at 0 or 1), but nothing
reaches the engine, which is verl's own (:mod:`.switched_off`).
"""

from __future__ import annotations

import dataclasses
import logging
from types import ModuleType
from typing import Any, Dict, Optional

from ..config import PrefixSharingConfig

__all__ = ["accept_prefix_grouper", "announce", "config_hooks", "sharing_config", "ATTRIBUTE"]

# Where the validated config rides on verl's engine config (an attribute, not a field).
ATTRIBUTE = "prefix_sharing"

logger = logging.getLogger(__name__)

_announced = False


def announce(class_name: str) -> None:
    """Logs, once per process, that a config asked for sharing and the environment said no."""
    global _announced
    if not _announced:
        _announced = True
        logger.warning("prefix-sharing: switched off by ENABLE_PREFIX_SHARING=0: %s asks for it "
                       "(use_prefix_grouper / prefix_grouper); verl runs its stock computation",
                       class_name)


def accept_prefix_grouper(module: ModuleType, *class_names: str, enabled: bool = True,
                          section: str | None = "engine") -> None:
    """Replaces each ``module.<class_name>`` (a verl config dataclass) by a subclass that
    accepts ``prefix_grouper`` (and ``use_prefix_grouper`` where verl's class lacks it: the
    critic's) and carries the sharing config to its engine config: the attribute ``section``
    of it (an actor or critic config's ``engine``), or the config itself with ``section=None``
    (an engine config: the SFT trainer's ``engine`` section). With ``enabled=False`` it only
    accepts and validates it (and says once that the environment switched sharing off, when
    the config asks for it). Names ``module`` lacks (a release without that class) are
    skipped."""
    for class_name in class_names:
        if hasattr(module, class_name):
            _accept(module, class_name, enabled, section)


def _accept(module: ModuleType, class_name: str, enabled: bool, section: str | None) -> None:
    base = getattr(module, class_name)
    if getattr(base, "_prefix_sharing_base", None) is not None:
        return  # already replaced

    def __post_init__(self) -> None:
        if hasattr(base, "__post_init__"):
            base.__post_init__(self)
        requested = PrefixSharingConfig.from_verl(self)  # a typo fails at 0 as at 1
        if enabled:
            if section is None:  # an engine config: attached only when asked (see _carry)
                if requested.enabled:
                    setattr(self, ATTRIBUTE, requested)
            else:
                _carry(getattr(self, section), requested, class_name)
        elif requested.enabled:
            announce(class_name)

    annotations: dict[str, Any] = {"prefix_grouper": Optional[Dict[str, Any]]}
    namespace: dict[str, Any] = {"prefix_grouper": dataclasses.field(default_factory=dict)}
    if "use_prefix_grouper" not in {f.name for f in dataclasses.fields(base)}:
        annotations["use_prefix_grouper"] = bool
        namespace["use_prefix_grouper"] = False
    namespace.update({
        "__annotations__": annotations,
        "__post_init__": __post_init__,
        "__doc__": f"{base.__doc__ or ''}\n    prefix_grouper: prefix-sharing options "
                   "(mode, min_prefix_len, min_group_size, backend, cross_micro_batch, "
                   "self_check).\n",
        "_prefix_sharing_base": base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    })
    cls = dataclasses.dataclass(type(class_name, (base,), namespace))
    setattr(module, class_name, cls)
    package = __import__(module.__name__.rpartition(".")[0], fromlist=["_"])
    if getattr(package, class_name, None) is base:
        setattr(package, class_name, cls)


def _carry(engine_config: Any, requested: PrefixSharingConfig, class_name: str) -> None:
    """Attaches a role section's ``requested`` to its ``engine_config``, unless the engine
    section asked for sharing itself: then it keeps its own, and a different request from the
    role section is an error. (An engine config attaches only a request for sharing, so that
    its role section can still attach one after it: verl's config classes freeze an attribute
    once set.)"""
    own = getattr(engine_config, ATTRIBUTE, None)
    if own is None:
        setattr(engine_config, ATTRIBUTE, requested)
    elif requested.enabled and requested != own:
        raise ValueError(f"{class_name}: prefix_grouper is set both in its section ({requested}) "
                         f"and in its engine section ({own}); set it in one of them")


def config_hooks(actor_classes: tuple[str, ...], critic_classes: tuple[str, ...],
                 engine_classes: tuple[str, ...], *, enabled: bool = True) -> dict:
    """A patch set's hooks on verl's config modules: its actor- and critic-config classes and
    its engine-config classes (the SFT trainer's ``engine`` section) accept the keys
    (:func:`accept_prefix_grouper`; ``enabled=False``: accepted and validated only)."""
    return {
        "verl.workers.config.actor":
            lambda m: accept_prefix_grouper(m, *actor_classes, enabled=enabled),
        "verl.workers.config.critic":
            lambda m: accept_prefix_grouper(m, *critic_classes, enabled=enabled),
        "verl.workers.config.engine":
            lambda m: accept_prefix_grouper(m, *engine_classes, enabled=enabled, section=None),
    }


def sharing_config(engine_config: Any) -> PrefixSharingConfig:
    """The sharing config verl's actor config attached to ``engine_config`` (``mode="off"``
    when there is none: the reference model without an overlay, or a hand-built engine)."""
    found = getattr(engine_config, ATTRIBUTE, None)
    return found if found is not None else PrefixSharingConfig(mode="off")
