"""The project's error for bad input: what a user can fix, shown to them as one line.

Everything else that goes wrong inside the library is a bug (or a broken installation) and keeps
its traceback: the ``prefix-sharing`` command prints one line for an :class:`InputError` and the
full traceback for anything else (``--debug`` shows it for both). Input errors stay
``ValueError``s, so callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations

__all__ = ["InputError", "MissingPackageError"]


class InputError(ValueError):
    """Bad input: an option, a file, a model or a parallel layout that cannot be used."""


class MissingPackageError(InputError, ImportError):
    """An optional package the requested run needs is not installed (the message says which
    ``pip install`` fixes it)."""
