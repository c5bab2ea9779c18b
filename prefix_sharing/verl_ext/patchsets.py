"""The registry of verl patch sets: what each supported verl release needs changed, and where.

A patch set is named after the verl release and engine it targets (``verl091_mcore``; the
prototype's names that also state the megatron-core / MindSpeed release map onto these, see
:mod:`.names`). It maps verl module names to hooks; a hook runs once, right after its module is
first imported (or at once if it already is), and receives that module. A patch-set module registers its sets at
import time and must not import verl or megatron at its top level: the registry imports every
built-in patch-set module when the first verl module is imported, to learn their targets.

To add a patch set (a new verl release, another engine), create a module that calls
:func:`register` and list it in :data:`BUILTIN_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Mapping
from types import ModuleType

__all__ = ["PatchSet", "register", "registered", "BUILTIN_MODULES"]

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


def registered() -> dict[str, PatchSet]:
    """Every known patch set, by name (imports the built-in patch-set modules once)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_MODULES:
            if importlib.util.find_spec(module) is not None:
                importlib.import_module(module)
    return dict(_REGISTRY)
