"""``prefix_sharing.setup``: the verl patch sets installed explicitly, under the prototype's name.

The prototype this project follows documents ``prefix_sharing.setup.install(...)`` for
"controlled environments that do not rely on import-time auto activation". It is the same
function as :func:`prefix_sharing.verl_ext.install` (one implementation, in
:mod:`prefix_sharing.verl_ext.activation`), and takes names as a list or as one
comma-separated string, in either spelling (``verl080_fsdp``, ``verl080_mcore0161_ms0160``,
``verl091_mcore``; see :mod:`prefix_sharing.verl_ext.names`)::

    import prefix_sharing
    prefix_sharing.setup.install("verl080_fsdp")   # before verl is imported

- :func:`install`: patch now and on every later import of a targeted verl module.
- :func:`installed`: the project's patch sets applied so far in this process.
- :func:`enabled`: whether ``ENABLE_PREFIX_SHARING`` lets this process share.
- :func:`patchsets`: the names that state the installed stack (``prefix-sharing patchsets``).
"""

from __future__ import annotations

from .verl_ext.activation import UnsupportedVerlVersion, enabled, install, installed
from .verl_ext.names import installed_stack, matching_names
from .verl_ext.patchsets import registered

__all__ = ["UnsupportedVerlVersion", "enabled", "install", "installed", "patchsets"]


def patchsets() -> list[str]:
    """The patch-set names for the installed verl, megatron-core and MindSpeed, in the
    prototype's spelling: the exact values for ``PREFIX_SHARING_PATCHSET`` on this machine
    (empty when verl is not installed or no patch set targets its release)."""
    return matching_names(registered(), installed_stack())
