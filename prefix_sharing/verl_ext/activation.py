"""Apply the verl patch sets when verl's modules are imported, in every process.

``import prefix_sharing`` calls :func:`activate`, which only puts a finder on ``sys.meta_path``:
verl is not imported. When a module that some patch set targets is imported later (by the
driver or by a Ray worker that imports ``prefix_sharing``: verl 0.9.1 through its plugin entry
point, :mod:`.plugin`; 0.8.0 through ``model.external_lib`` / ``VERL_USE_EXTERNAL_MODULES``),
the finder runs the patch set's hook right after the module's own code. Modules imported
before ``prefix_sharing`` are patched at once. Everything is idempotent.

Environment (read by the first :func:`install`, i.e. at ``import prefix_sharing``):
    ENABLE_PREFIX_SHARING: ``1`` (the default) shares; ``0`` runs verl's stock computation with
        the same config: each selected set applies only its ``off_hooks`` (the config keys are
        accepted, nothing reaches the engines; :mod:`.switched_off`), and a verl release no set
        targets is left alone.
    PREFIX_SHARING_PATCHSET: comma-separated patch-set names, in the project's spelling
        (``verl091_mcore``) or the prototype's (``verl080_mcore0161_ms0160``, see
        :mod:`.names`). Narrows the sets applied to these; a named set is applied even when the
        installed verl is not a release it targets (the override for an untested verl release),
        with one warning per name whose stated stack is not the installed one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Iterable
from types import ModuleType

from . import names

__all__ = ["activate", "enabled", "install", "installed", "UnsupportedVerlVersion"]

logger = logging.getLogger(__name__)

ENABLE_ENV = "ENABLE_PREFIX_SHARING"
PATCHSET_ENV = "PREFIX_SHARING_PATCHSET"


class UnsupportedVerlVersion(RuntimeError):
    """The installed verl is not a release any patch set targets."""


class _State:
    finder: _PatchFinder | None = None
    enabled: bool | None = None  # ENABLE_PREFIX_SHARING, read by the first install()
    requested: tuple[str, ...] | None = None  # names from install() / the environment
    selected: dict | None = None  # name -> PatchSet, decided at the first verl import
    applied: set[tuple[str, str]] = set()  # (patch set, module) pairs already hooked


def activate() -> None:
    """What ``import prefix_sharing`` runs: :func:`install` (which reads the environment)."""
    install()


def enabled() -> bool:
    """Whether this process shares (``ENABLE_PREFIX_SHARING``, as the first :func:`install`
    read it)."""
    return _State.enabled if _State.enabled is not None else _switch()


def install(patchsets: Iterable[str] | str | None = None) -> None:
    """Patch verl for prefix sharing now and on every later import of a targeted module.

    Also ``prefix_sharing.setup.install``, the prototype's name for it. With
    ``ENABLE_PREFIX_SHARING=0`` only the config acceptance is patched (see the module doc).

    Args:
        patchsets: names of the patch sets to apply (forced, whatever the verl release), as a
            list or one comma-separated string (``"verl080_fsdp,verl080_mcore0161_ms0160"``);
            ``None`` applies the sets named by ``PREFIX_SHARING_PATCHSET``, or else every set
            that targets the installed verl release. Names may be changed by a later call until
            verl is first imported (``import prefix_sharing`` installs the default).

    Raises:
        UnsupportedVerlVersion: when verl is (or gets) imported and no patch set targets its
            release. Naming a patch set overrides the check.
        ValueError: an unknown patch-set name, a name stating a stack that cannot exist here
            (megatron-core 0.17+ on Python < 3.12), a call naming other sets after verl was
            patched, or ``ENABLE_PREFIX_SHARING`` other than 0 or 1.
    """
    requested = _requested(patchsets)
    if _State.selected is not None and requested != _State.requested:
        raise ValueError(
            f"prefix-sharing verl patch sets are already applied as "
            f"{list(_State.requested) or 'auto'}; cannot switch to {list(requested) or 'auto'} in the same process (name them "
            f"before verl is imported, or in {PATCHSET_ENV})"
        )
    if _State.enabled is None:
        _State.enabled = _switch()
    _State.requested = requested
    if _State.finder is None:
        _State.finder = _PatchFinder()
        sys.meta_path.insert(0, _State.finder)
    if "verl" in sys.modules:
        _patch_imported_modules()


def _switch() -> bool:
    flag = os.environ.get(ENABLE_ENV, "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{ENABLE_ENV} must be 0 or 1; got {flag!r}")
    return flag == "1"


def installed() -> list[str]:
    """Names of the patch sets applied so far in this process (empty before verl is imported;
    with sharing switched off, :func:`enabled` is False and only their off_hooks ran)."""
    return sorted({name for name, _ in _State.applied})


def _requested(patchsets: Iterable[str] | str | None) -> tuple[str, ...]:
    if patchsets is None:
        patchsets = os.environ.get(PATCHSET_ENV, "")
    if isinstance(patchsets, str):
        patchsets = patchsets.split(",")
    return tuple(sorted({n.strip() for n in patchsets if n.strip()}))


def _select() -> dict:
    """The patch sets to apply, decided once, when verl is first seen."""
    if _State.selected is not None:
        return _State.selected
    from .patchsets import registered

    known = registered()
    stack = names.installed_stack()
    if _State.requested:
        selected = {}
        for name in _resolve_requested(known, stack):
            selected.update((ps, known[ps]) for ps in name.patchsets)
    else:
        selected = {n: ps for n, ps in known.items() if stack.verl in ps.verl_versions}
        if not selected and _State.enabled:
            supported = sorted({v for ps in known.values() for v in ps.verl_versions})
            raise UnsupportedVerlVersion(
                f"prefix-sharing supports verl {', '.join(supported)}; verl {stack.verl} is "
                f"installed. Install a supported release, force a patch set with "
                f"{PATCHSET_ENV}=<name> (one of {', '.join(sorted(known))}), or set "
                f"{ENABLE_ENV}=0 to leave verl alone."
            )
    _State.selected = selected
    return selected


def _resolve_requested(known: dict, stack: names.Stack) -> list[names.PatchSetName]:
    """The requested names resolved; unknown names and impossible stacks raise, a stated stack
    other than the installed one warns (once per name; not with sharing switched off)."""
    resolved = {n: names.resolve(n, known) for n in _State.requested}
    unknown = [n for n, r in resolved.items() if r is None]
    if unknown:
        raise ValueError(
            f"{PATCHSET_ENV}/install() names unknown verl patch set(s) {unknown}; "
            f"known: {names.known_names(known)}"
        )
    if not _State.enabled:
        return list(resolved.values())
    for name in resolved.values():
        differences, impossible = names.stack_problems(name, stack)
        if impossible:
            raise ValueError(
                f"{PATCHSET_ENV}/install() names {name.name}, a stack that cannot be this one: "
                f"{'; '.join(impossible)}. For this stack: "
                f"{', '.join(names.matching_names(known, stack)) or 'none'}"
            )
        if differences:
            logger.warning("prefix-sharing: patch set %s is for %s; applying %s anyway",
                           name.name, ", ".join(differences), " + ".join(name.patchsets))
    return list(resolved.values())


def _hooks(patchset) -> dict:
    """What a selected set applies: its hooks, or with sharing switched off its off_hooks."""
    return patchset.hooks if _State.enabled else patchset.off_hooks


def _targets() -> set[str]:
    return {target for ps in _select().values() for target in _hooks(ps)}


def _patch_imported_modules() -> None:
    for ps in _select().values():
        for target in _hooks(ps):
            if target in sys.modules:
                _apply(ps, target, sys.modules[target])


def _apply(patchset, target: str, module: ModuleType) -> None:
    key = (patchset.name, target)
    if key not in _State.applied:
        _State.applied.add(key)
        _hooks(patchset)[target](module)


def _run_hooks(module: ModuleType) -> None:
    for ps in _select().values():
        if module.__name__ in _hooks(ps):
            _apply(ps, module.__name__, module)


class _PatchFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each targeted verl module so the hooks run after its code."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("verl.") or fullname not in _targets():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hooks(module)

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and pkgutil
        return getattr(self._loader, name)
