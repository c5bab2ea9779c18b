"""Choosing a kernel backend by name: one resolver for every kernel family.

Attention (:mod:`prefix_sharing.attention.backends`), the gated delta rule
(:mod:`prefix_sharing.recurrent.gated_delta`) and the Mamba-2 scan
(:mod:`prefix_sharing.recurrent.ssd`) each offer a pure-torch reference and faster kernels from
optional packages, chosen by the same rules: ``"auto"`` takes the first candidate for the
device that computes in the inputs' dtype and is installed, else ``"torch"``; a named backend
must exist and compute in that dtype; a named backend whose package is missing is one clear
error saying how to install it. The packages are looked up, never imported, so resolving a
name costs nothing and imports nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping

import torch

from .errors import InputError, MissingPackageError

__all__ = ["KernelBackends", "Package"]


@dataclasses.dataclass(frozen=True)
class Package:
    """What a backend imports: the module ``name``, said as ``needs`` in an error, installed
    with ``install``."""

    name: str
    needs: str
    install: str


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """One kernel family's backends and how a name resolves to one.

    Attributes:
        kind: what the name chooses, as errors say it (``"attention backend"``).
        packages: every backend, with the package it imports (``None``: torch alone).
        auto: device type -> the candidates ``"auto"`` tries there, fastest first.
        dtypes: backend -> the dtypes it computes in; a backend not listed takes any.
        native: backends whose device type exists only once their package is imported
            (torch_npu's ``"npu"``): on that device ``"auto"`` takes them without a lookup.
    """

    kind: str
    packages: Mapping[str, Package | None]
    auto: Mapping[str, tuple[str, ...]]
    dtypes: Mapping[str, tuple[torch.dtype, ...]] = dataclasses.field(default_factory=dict)
    native: frozenset[str] = frozenset()

    def resolve(self, name: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
        """The concrete backend for ``name`` (``"auto"`` or a backend) on ``device`` for
        inputs of ``dtype`` (``None``: no dtype rule).

        Raises:
            InputError (a ValueError): an unknown name, or a named backend that does not
                compute in ``dtype``.
        """
        if name == "auto":
            for candidate in self.auto.get(device.type, ()):
                if self.computes_in(candidate, dtype) and (
                        candidate in self.native or self.installed(candidate)):
                    return candidate
            return "torch"
        if name not in self.packages:
            raise InputError(f"unknown {self.kind} {name!r}; choose from "
                             f"{', '.join(['auto', *self.packages])}")
        if not self.computes_in(name, dtype):
            kinds = ", ".join(str(d) for d in self.dtypes[name])
            raise InputError(
                f"{self.kind} {name!r} computes in {kinds} only, but q is {dtype}: run the "
                "model in one of those dtypes, or choose backend='torch' (or 'auto')"
            )
        return name

    def computes_in(self, name: str, dtype: torch.dtype | None) -> bool:
        """Whether backend ``name`` has a kernel for inputs of ``dtype`` (``None``: any)."""
        kinds = self.dtypes.get(name)
        return dtype is None or kinds is None or dtype in kinds

    def installed(self, name: str) -> bool:
        """Whether ``name``'s package can be imported (looked up, not imported)."""
        package = self.packages[name]
        return package is None or importlib.util.find_spec(package.name) is not None

    def require(self, name: str) -> None:
        """Raises :class:`MissingPackageError` (an ImportError) when ``name``'s package is
        missing, saying how to install it."""
        if not self.installed(name):
            package = self.packages[name]
            raise MissingPackageError(f"{self.kind} {name!r} needs {package.needs} "
                                      f"({package.install}), or choose backend='torch'")
