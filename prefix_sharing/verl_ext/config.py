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

__all__ = ["accept_prefix_grouper", "announce", "sharing_config", "ATTRIBUTE"]

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


def accept_prefix_grouper(module: ModuleType, *class_names: str, enabled: bool = True) -> None:
    """Replaces each ``module.<class_name>`` (a verl actor- or critic-config dataclass) by a
    subclass that accepts ``prefix_grouper`` (and ``use_prefix_grouper`` where the class has
    none: the critic's) and carries the sharing config to its ``engine``; with
    ``enabled=False`` it only accepts and validates them (and says once that the environment
    switched sharing off, when the config asks for it). Names ``module`` lacks (a release
    without that class) are skipped."""
    for class_name in class_names:
        if hasattr(module, class_name):
            _accept(module, class_name, enabled)


def _accept(module: ModuleType, class_name: str, enabled: bool) -> None:
    base = getattr(module, class_name)
    if getattr(base, "_prefix_sharing_base", None) is not None:
        return  # already replaced

    def __post_init__(self) -> None:
        base.__post_init__(self)
        requested = PrefixSharingConfig.from_verl(self)  # a typo fails at 0 as at 1
        if enabled:
            setattr(self.engine, ATTRIBUTE, requested)
        elif requested.enabled:
            announce(class_name)

    annotations: dict[str, Any] = {"prefix_grouper": Optional[Dict[str, Any]]}
    fields: dict[str, Any] = {"prefix_grouper": dataclasses.field(default_factory=dict)}
    if "use_prefix_grouper" not in {f.name for f in dataclasses.fields(base)}:
        annotations["use_prefix_grouper"] = bool
        fields["use_prefix_grouper"] = False
    namespace = {
        "__annotations__": annotations,
        **fields,
        "__post_init__": __post_init__,
        "__doc__": f"{base.__doc__ or ''}\n    prefix_grouper: prefix-sharing options "
                   "(mode, min_prefix_len, min_group_size, backend, cross_micro_batch, "
                   "self_check).\n",
        "_prefix_sharing_base": base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    cls = dataclasses.dataclass(type(class_name, (base,), namespace))
    setattr(module, class_name, cls)
    package = __import__(module.__name__.rpartition(".")[0], fromlist=["_"])
    if getattr(package, class_name, None) is base:
        setattr(package, class_name, cls)


def sharing_config(engine_config: Any) -> PrefixSharingConfig:
    """The sharing config verl's actor config attached to ``engine_config`` (``mode="off"``
    when there is none: the reference model without an overlay, or a hand-built engine)."""
    found = getattr(engine_config, ATTRIBUTE, None)
    return found if found is not None else PrefixSharingConfig(mode="off")
