"""Patch-set names: the prototype's scheme, mapped onto the project's patch sets.

The project registers one patch set per verl release and engine (``verl091_mcore``,
``verl091_mcore_mindspeed``, ``verl091_fsdp``, ...). The prototype this project follows names
its sets after the whole stack they were tested on, and its users' scripts say so in
``PREFIX_SHARING_PATCHSET``; both spellings are accepted:

=====================================  ======================================================
name                                   patch sets applied
=====================================  ======================================================
``verl080_fsdp``                       ``verl080_fsdp``
``verl091_mcore``                      ``verl091_mcore`` (no release stated, none checked)
``verl091_mcore0192``                  ``verl091_mcore``; states megatron-core 0.19.2
``verl080_mcore0161_ms0160``           ``verl080_mcore`` + ``verl080_mcore_mindspeed``; states
                                       megatron-core 0.16.1 and MindSpeed ``core_r0.16.0``
``verl091_mcore_mindspeed``            ``verl091_mcore`` + ``verl091_mcore_mindspeed``
=====================================  ======================================================

Digits: verl ``091`` is 0.9.1, megatron-core ``0161`` is 0.16.1 (major, two-digit minor, patch),
MindSpeed ``ms0160`` is its branch ``core_r0.16.0`` (package version 0.16.0). A stated release
is checked against the installed one when the set is applied (:func:`stack_problems`): a
difference is a warning, a stack that cannot exist (megatron-core 0.17+ on Python < 3.12) an
error. A MindSpeed branch is written for one megatron-core minor release; a name pairing it with
another is not a known name.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping

from ..releases import MEGATRON_CORE_RELEASES

__all__ = ["MCORE_RELEASES", "MINDSPEED_RELEASES", "PatchSetName", "Stack", "resolve",
           "known_names", "matching_names", "installed_stack", "stack_problems"]

# megatron-core releases the project is tested with -> the oldest Python each one installs on.
MCORE_RELEASES: dict[str, tuple[int, int]] = MEGATRON_CORE_RELEASES
# MindSpeed package versions (branch core_r<version>) -> the megatron-core minor it patches.
MINDSPEED_RELEASES: dict[str, str] = {"0.16.0": "0.16"}

_NAME = re.compile(r"verl(?P<verl>\d{3})_(?:(?P<fsdp>fsdp)|mcore(?:(?P<mcore>\d{4})"
                   r"(?:_ms(?P<ms>\d{4}))?|(?P<mindspeed>_mindspeed))?)")


@dataclasses.dataclass(frozen=True)
class PatchSetName:
    """A name as a user wrote it, resolved.

    Attributes:
        name: as written (``verl080_mcore0161_ms0160``).
        patchsets: the project's patch sets it applies, in order (Megatron before MindSpeed).
        verl: the verl release it targets (``0.8.0``).
        megatron_core, mindspeed: the releases it states (``0.16.1``, ``0.16.0``), or ``None``.
    """

    name: str
    patchsets: tuple[str, ...]
    verl: str
    megatron_core: str | None = None
    mindspeed: str | None = None


@dataclasses.dataclass(frozen=True)
class Stack:
    """The installed releases (``None``: not installed), read without importing the packages."""

    verl: str | None
    megatron_core: str | None
    mindspeed: str | None
    python: tuple[int, int, int]


def _release(digits: str) -> str:
    """``091`` -> ``0.9.1``; ``0161`` -> ``0.16.1`` (major, two-digit minor, patch)."""
    if len(digits) == 3:
        return ".".join(digits)
    return f"{int(digits[0])}.{int(digits[1:3])}.{int(digits[3])}"


def _digits(release: str, width: int) -> str:
    major, minor, patch = (int(part) for part in release.split("."))
    return f"{major}{minor}{patch}" if width == 3 else f"{major}{minor:02d}{patch}"


def resolve(name: str, registered: Mapping[str, object]) -> PatchSetName | None:
    """``name`` resolved against the registered patch sets, or ``None`` if it is not a known
    name (a malformed name, a verl release without patch sets, a megatron-core or MindSpeed
    release outside the tested ones, a MindSpeed branch paired with another megatron-core)."""
    match = _NAME.fullmatch(name.strip())
    if match is None:
        return None
    verl = _release(match["verl"])
    engine = "fsdp" if match["fsdp"] else "mcore"
    patchsets = [f"verl{match['verl']}_{engine}"]
    mcore = _release(match["mcore"]) if match["mcore"] else None
    mindspeed = _release(match["ms"]) if match["ms"] else None
    if match["ms"] or match["mindspeed"]:
        patchsets.append(f"verl{match['verl']}_mcore_mindspeed")
    if any(ps not in registered for ps in patchsets):
        return None
    if mcore is not None and mcore not in MCORE_RELEASES:
        return None
    if mindspeed is not None and (
            MINDSPEED_RELEASES.get(mindspeed) is None
            or (mcore is not None and not mcore.startswith(MINDSPEED_RELEASES[mindspeed] + "."))):
        return None
    return PatchSetName(name.strip(), tuple(patchsets), verl, mcore, mindspeed)


def _names_for(verl_digits: str, mcores: Iterable[str], mindspeeds: Iterable[str]) -> list[str]:
    """The scheme's names for one verl release, the given megatron-core / MindSpeed releases."""
    mindspeeds = list(mindspeeds)
    names = [f"verl{verl_digits}_fsdp"]
    for mcore in mcores:
        names.append(f"verl{verl_digits}_mcore{_digits(mcore, 4)}")
        names += [f"verl{verl_digits}_mcore{_digits(mcore, 4)}_ms{_digits(ms, 4)}"
                  for ms in mindspeeds if mcore.startswith(MINDSPEED_RELEASES[ms] + ".")]
    return names


def known_names(registered: Mapping[str, object]) -> list[str]:
    """Every name :func:`resolve` accepts: the registered sets and the scheme's names."""
    names = set(registered)
    for ps in registered:
        verl_digits = ps[len("verl"):len("verl") + 3]
        names.update(n for n in _names_for(verl_digits, MCORE_RELEASES, MINDSPEED_RELEASES)
                     if resolve(n, registered) is not None)
    return sorted(names)


def matching_names(registered: Mapping[str, object], stack: Stack) -> list[str]:
    """The names that state exactly the installed stack (its verl, megatron-core, MindSpeed):
    what to put in ``PREFIX_SHARING_PATCHSET`` on this machine. Empty when verl is not
    installed or no patch set targets its release."""
    if stack.verl is None or not re.fullmatch(r"\d+\.\d+\.\d+", stack.verl):
        return []
    mcores = [stack.megatron_core] if _tested(stack.megatron_core, MCORE_RELEASES) else []
    mindspeeds = [stack.mindspeed] if _tested(stack.mindspeed, MINDSPEED_RELEASES) else []
    candidates = _names_for(_digits(stack.verl, 3), mcores, mindspeeds)
    return [n for n in candidates if resolve(n, registered) is not None
            and not stack_problems(resolve(n, registered), stack)[0]]


def _tested(version: str | None, releases: Mapping[str, object]) -> bool:
    return version is not None and version in releases


def installed_stack() -> Stack:
    """The installed verl, megatron-core and MindSpeed releases (package metadata; nothing is
    imported) and the running Python."""
    def version(dist: str) -> str | None:
        try:
            return _base_release(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            return None

    module = sys.modules.get("verl")
    verl = getattr(module, "__version__", None) or version("verl")
    return Stack(verl=_base_release(str(verl)) if verl else None,
                 megatron_core=version("megatron-core"), mindspeed=version("mindspeed"),
                 python=tuple(sys.version_info[:3]))


def _base_release(version: str) -> str:
    """``0.16.1rc0`` / ``0.16.1+cu124`` -> ``0.16.1`` (what a name can state)."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return found.group(0) if found else version


def stack_problems(name: PatchSetName, stack: Stack) -> tuple[list[str], list[str]]:
    """How the stack ``name`` states differs from the installed one: ``(differences,
    impossibilities)``. A difference (another release installed, or none) is worth a warning;
    an impossibility (megatron-core 0.17+ named on Python < 3.12) means the named stack cannot
    be this one."""
    differences, impossible = [], []
    if stack.verl != name.verl:
        differences.append(f"verl {name.verl} (installed: {stack.verl or 'none'})")
    if name.megatron_core is not None:
        needs = MCORE_RELEASES[name.megatron_core]
        if stack.python[:2] < needs:
            impossible.append(
                f"megatron-core {name.megatron_core} needs Python >= {needs[0]}.{needs[1]}; "
                f"this is Python {'.'.join(map(str, stack.python))}")
        elif stack.megatron_core != name.megatron_core:
            differences.append(f"megatron-core {name.megatron_core} "
                               f"(installed: {stack.megatron_core or 'none'})")
    if name.mindspeed is not None and stack.mindspeed != name.mindspeed:
        differences.append(f"MindSpeed core_r{name.mindspeed} "
                           f"(installed: {stack.mindspeed or 'none'})")
    return differences, impossible
