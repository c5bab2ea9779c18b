"""The project's error for bad input: what a user can fix, shown to them as one line.

Everything else that goes wrong inside the library is a bug (or a broken installation) and keeps
its traceback: the ``prefix-sharing`` command prints one line for an :class:`InputError` and the
full traceback for anything else (``--debug`` shows it for both). Input errors stay
``ValueError``s, so callers that catch ``ValueError`` keep working. A setup that prefix sharing
refuses (:class:`UnsupportedSetup`) is bad input too: the user changes the setting it names.
"""

from __future__ import annotations

__all__ = ["InputError", "MissingPackageError", "PrefixSharingSetupError", "UnsupportedSetup",
           "RankKilled"]


class InputError(ValueError):
    """Bad input: an option, a file, a model or a parallel layout that cannot be used."""


class MissingPackageError(InputError, ImportError):
    """An optional package the requested run needs is not installed (the message says which
    ``pip install`` fixes it)."""


class UnsupportedSetup(InputError):
    """A model or parallel setting under which prefix sharing would not give the plain results;
    the message names the setting and what to use instead. Megatron's refusals raise
    :class:`prefix_sharing.megatron_ext.UnsupportedSetupError`, which is also a
    ``RuntimeError``."""


class PrefixSharingSetupError(UnsupportedSetup):
    """A verl engine or trainer setting that prefix sharing cannot run with (raised by
    :mod:`prefix_sharing.verl_ext`; bad input: a ``ValueError``)."""


class RankKilled(InputError):
    """A spawned rank was killed by a signal (on Linux, SIGKILL is most often the out-of-memory
    killer): the run asked more of the machine than it had, which the user changes by asking
    less; shown as one line like bad input."""
