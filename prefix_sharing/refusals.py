"""Every setting prefix sharing refuses, in one table, and the one way to raise a refusal.

A refusal is a setup under which sharing could not give the plain forward's results (or has not
been shown to): a model, a parallel layout, a kernel, a release. Each has one entry in
:data:`REFUSALS` (its tables live in :mod:`.refusal_table`): a stable key, the setting (a short
noun phrase), the reason with what to use instead, and the engines whose path checks it. A site
raises ``refuse(key, detail)``, where ``detail`` is what it found (the offending value, the
layer); a check that collects several problems gathers :class:`Refused` items and raises
:func:`refuse_all` once. The message names every setting, its detail and its reason, and ends
each with its key, which ``docs/support.md`` (generated from this table) lists.

The error class stays the site's own: :class:`~.errors.UnsupportedSetup` by default, megatron's
``UnsupportedSetupError`` (also a ``RuntimeError``) or verl's ``PrefixSharingSetupError`` where
the site passes it - this module imports neither integration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import UnsupportedSetup
from .refusal_table import ENGINES, TABLE, Refusal

__all__ = ["ENGINES", "REFUSALS", "Refusal", "Refused", "refuse", "refuse_all"]


def _registry(entries: Iterable[Refusal]) -> dict[str, Refusal]:
    table: dict[str, Refusal] = {}
    for entry in entries:
        if entry.key in table:
            raise ValueError(f"refusal key {entry.key!r} is registered twice")
        unknown = set(entry.engines) - set(ENGINES)
        if not entry.engines or unknown:
            raise ValueError(f"refusal {entry.key!r} names engines {entry.engines}; "
                             f"the vocabulary is {ENGINES}")
        table[entry.key] = entry
    return table


REFUSALS: dict[str, Refusal] = _registry(TABLE)


@dataclass(frozen=True)
class Refused:
    """One refused setting a check found: the table's ``key`` and the site's ``detail`` (what
    it found, e.g. ``"mtp_num_layers=2"``). ``str()`` is its part of the message."""

    key: str
    detail: str | None = None

    def __post_init__(self) -> None:
        if self.key not in REFUSALS:  # a bug at the site: tests/test_refusals.py catches it
            raise KeyError(f"{self.key!r} is not a registered refusal (prefix_sharing.refusals)")

    @property
    def entry(self) -> Refusal:
        return REFUSALS[self.key]

    def __str__(self) -> str:
        entry = self.entry
        detail = f" ({self.detail})" if self.detail else ""
        return f"{entry.setting}{detail}: {entry.reason} [{self.key}]"


def refuse_all(found: Iterable[Refused], *, error: type[UnsupportedSetup] = UnsupportedSetup,
               advice: str | None = None) -> UnsupportedSetup:
    """The ``error`` naming every refusal in ``found`` (at least one), then ``advice`` common
    to all of them, for ``raise``; its ``refusals`` attribute holds their keys, ``found`` the
    :class:`Refused` items."""
    found = list(found)
    if not found:
        raise ValueError("refuse_all needs at least one refusal")
    message = "prefix sharing refuses " + "; ".join(map(str, found))
    exception = error(message + (f". {advice}" if advice else ""))

    exception.refusals = tuple(item.key for item in found)
    exception.found = tuple(found)  # for a caller that reports them one by one (preflight)
    return exception


def refuse(key: str, detail: str | None = None, *,
           error: type[UnsupportedSetup] = UnsupportedSetup) -> UnsupportedSetup:
    """The ``error`` refusing the setting registered as ``key``, with the site's ``detail``:
    ``raise refuse("megatron.mtp", f"mtp_num_layers={n}", error=UnsupportedSetupError)``."""
    return refuse_all([Refused(key, detail)], error=error)
