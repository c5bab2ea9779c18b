"""The registry of verl patch sets: what each supported verl release needs changed, and where.

A patch set is named after the verl release and engine it targets (``verl091_mcore``; the
prototype's names that also state the megatron-core / MindSpeed release map onto these, see
:mod:`.names`). It maps verl module names to hooks; a hook runs once, right after its module is
first imported (or at once if it already is), and receives that module. A patch-set module registers its sets at
import time and must not import verl or megatron at its top level: the registry imports every
built-in patch-set module when the first verl module is imported, to learn their targets.

The verl releases and the engines each has a set for are one table,
:data:`prefix_sharing.releases.VERL_RELEASES`; a built-in module registers its engine's set
for every release listed there with :func:`register_releases`. A new verl release is a row in
that table; another engine is a module that calls :func:`register_releases` (or
:func:`register`), listed in :data:`BUILTIN_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Mapping
from types import ModuleType

from ..releases import verl_patchsets

__all__ = ["PatchSet", "register", "register_releases", "registered", "BUILTIN_MODULES"]

Hook = Callable[[ModuleType], None]

# Modules that define patch sets; those not present in this checkout are skipped.
BUILTIN_MODULES: tuple[str, ...] = (
    "prefix_sharing.verl_ext.mcore_engine",
    "prefix_sharing.verl_ext.mindspeed",
    "prefix_sharing.verl_ext.fsdp",
)


@dataclasses.dataclass(frozen=True)
class PatchSet:
    """One coherent set of changes to one verl release.

    Attributes:
        name: ``verl<release digits>_<engine>``, e.g. ``verl091_mcore``; what
            ``PREFIX_SHARING_PATCHSET`` names.
        verl_versions: the verl releases it was written and tested against.
        hooks: verl module name -> hook, applied once when that module is imported.
        summary: one line for error messages and ``installed()``.
        off_hooks: what is applied instead with ``ENABLE_PREFIX_SHARING=0``: only what lets
            the same config run verl's stock computation (:mod:`.switched_off`).
    """

    name: str
    verl_versions: tuple[str, ...]
    hooks: Mapping[str, Hook]
    summary: str = ""
    off_hooks: Mapping[str, Hook] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[str, PatchSet] = {}
_loaded = False


def register(patchset: PatchSet) -> PatchSet:
    """Adds a patch set; registering the same name twice with a different set is an error."""
    known = _REGISTRY.get(patchset.name)
    if known is not None and known is not patchset:
        raise ValueError(f"a verl patch set named {patchset.name!r} is already registered")
    _REGISTRY[patchset.name] = patchset
    return patchset


def register_releases(engine: str, hooks: Mapping[str, Hook], summary: str,
                      off_hooks: Mapping[str, Hook] | None = None) -> tuple[PatchSet, ...]:
    """Registers ``engine``'s patch set, ``verl<digits>_<engine>``, for every verl release
    :data:`~prefix_sharing.releases.VERL_RELEASES` lists with that engine, each with the
    same hooks (a hook handles what differs between releases in the module it patches).
    ``summary`` is formatted with ``release``."""
    return tuple(
        register(PatchSet(name=name, verl_versions=(release,), hooks=dict(hooks),
                          summary=summary.format(release=release),
                          off_hooks=dict(off_hooks or {})))
        for release, name in verl_patchsets(engine)
    )


def registered() -> dict[str, PatchSet]:
    """Every known patch set, by name (imports the built-in patch-set modules once)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            if importlib.util.find_spec(module) is not None:
                importlib.import_module(module)
    return dict(_REGISTRY)
