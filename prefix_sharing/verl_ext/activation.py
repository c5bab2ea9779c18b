"""Apply the verl patch sets when verl's modules are imported, in every process.

``import prefix_sharing`` calls :func:`activate`, which only puts a finder on ``sys.meta_path``:
verl is not imported. When a module that some patch set targets is imported later (by the
driver or by a Ray worker that imports ``prefix_sharing`` through verl's
``model.external_lib`` / ``VERL_USE_EXTERNAL_MODULES``), the finder runs the patch set's hook
right after the module's own code. Modules imported before ``prefix_sharing`` are patched at
once. Everything is idempotent.

Environment:
    ENABLE_PREFIX_SHARING: ``0`` leaves verl untouched (exactly the stock code path); ``1``
        (the default) activates.
    PREFIX_SHARING_PATCHSET: comma-separated patch-set names. Narrows the sets applied to these;
        a named set is applied even when the installed verl is not a release it targets (the
        override for an untested verl release).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import os
import sys
from collections.abc import Iterable
from types import ModuleType

__all__ = ["activate", "install", "installed", "UnsupportedVerlVersion"]

logger = logging.getLogger(__name__)

ENABLE_ENV = "ENABLE_PREFIX_SHARING"
PATCHSET_ENV = "PREFIX_SHARING_PATCHSET"


class UnsupportedVerlVersion(RuntimeError):
    """The installed verl is not a release any patch set targets."""


class _State:
    finder: _PatchFinder | None = None
    requested: tuple[str, ...] | None = None  # names from install() / the environment
    selected: dict | None = None  # name -> PatchSet, decided at the first verl import
    applied: set[tuple[str, str]] = set()  # (patch set, module) pairs already hooked


def activate() -> None:
    """What ``import prefix_sharing`` runs: :func:`install` unless ``ENABLE_PREFIX_SHARING=0``."""
    flag = os.environ.get(ENABLE_ENV, "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{ENABLE_ENV} must be 0 or 1; got {flag!r}")
    if flag == "1":
        install()


def install(patchsets: Iterable[str] | None = None) -> None:
    """Patch verl for prefix sharing now and on every later import of a targeted module.

    Args:
        patchsets: names of the patch sets to apply (forced, whatever the verl release);
            ``None`` applies every set that targets the installed verl release, or the sets
            named by ``PREFIX_SHARING_PATCHSET``.

    Raises:
        UnsupportedVerlVersion: when verl is (or gets) imported and no patch set targets its
            release. Naming a patch set overrides the check.
        ValueError: an unknown patch-set name, or a second call naming different sets.
    """
    requested = _requested(patchsets)
    if _State.requested is not None and requested != _State.requested:
        raise ValueError(
            f"prefix-sharing verl patch sets are already installed as {list(_State.requested) or 'auto'}; "
            f"cannot switch to {list(requested) or 'auto'} in the same process"
        )
    _State.requested = requested
    if _State.finder is None:
        _State.finder = _PatchFinder()
        sys.meta_path.insert(0, _State.finder)
    if "verl" in sys.modules:
        _patch_imported_modules()


def installed() -> list[str]:
    """Names of the patch sets applied so far in this process (empty before verl is imported)."""
    return sorted({name for name, _ in _State.applied})


def _requested(patchsets: Iterable[str] | None) -> tuple[str, ...]:
    if patchsets is None:
        patchsets = [n for n in os.environ.get(PATCHSET_ENV, "").split(",") if n.strip()]
    elif isinstance(patchsets, str):
        raise TypeError("install(patchsets=...) takes a list of names, not a string")
    return tuple(sorted(n.strip() for n in patchsets))


def _select() -> dict:
    """The patch sets to apply, decided once, when verl is first seen."""
    if _State.selected is not None:
        return _State.selected
    from .patchsets import registered

    known = registered()
    version = _verl_version()
    if _State.requested:
        unknown = [n for n in _State.requested if n not in known]
        if unknown:
            raise ValueError(
                f"{PATCHSET_ENV}/install() names unknown verl patch set(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        selected = {n: known[n] for n in _State.requested}
        for ps in selected.values():
            if version not in ps.verl_versions:
                logger.warning("prefix-sharing: forcing patch set %s (for verl %s) on verl %s",
                               ps.name, "/".join(ps.verl_versions), version)
    else:
        selected = {n: ps for n, ps in known.items() if version in ps.verl_versions}
        if not selected:
            supported = sorted({v for ps in known.values() for v in ps.verl_versions})
            raise UnsupportedVerlVersion(
                f"prefix-sharing supports verl {', '.join(supported)}; verl {version} is installed. "
                f"Install a supported release, force a patch set with {PATCHSET_ENV}=<name> "
                f"(one of {', '.join(sorted(known))}), or set {ENABLE_ENV}=0 to leave verl alone."
            )
    _State.selected = selected
    return selected


def _verl_version() -> str:
    module = sys.modules.get("verl")
    version = getattr(module, "__version__", None)
    return str(version) if version else importlib.metadata.version("verl")


def _targets() -> set[str]:
    return {target for ps in _select().values() for target in ps.hooks}


def _patch_imported_modules() -> None:
    for ps in _select().values():
        for target in ps.hooks:
            if target in sys.modules:
                _apply(ps, target, sys.modules[target])


def _apply(patchset, target: str, module: ModuleType) -> None:
    key = (patchset.name, target)
    if key not in _State.applied:
        _State.applied.add(key)
        patchset.hooks[target](module)


def _run_hooks(module: ModuleType) -> None:
    for ps in _select().values():
        if module.__name__ in ps.hooks:
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
