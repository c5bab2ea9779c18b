"""Which megatron-core releases this package is tested on, and the guard on import.

Every megatron-core release has changed a form this package relies on (the MoE spec became a
``partial`` in 0.18, the router's constructor gained keywords in 0.17, ...), and a form missed
means a stock module left in place: results that change silently. So only the releases the
tests run on are accepted - exact releases, patch releases included, since patch releases
have changed these forms too. An untested release is refused unless the environment names it.

Environment:
    PREFIX_SHARING_ALLOW_MCORE: the installed megatron-core version (e.g. ``0.20.0``), to run
        on that untested release anyway, with a warning. Naming the version, not a yes/no
        flag, means an upgrade later is refused again until someone looks at it.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from ..errors import MissingPackageError
from ..releases import MEGATRON_CORE_RELEASES

__all__ = ["ALLOW_ENV", "TESTED_RELEASES", "UnsupportedMegatronRelease", "check_release",
           "installed_release"]

TESTED_RELEASES = tuple(MEGATRON_CORE_RELEASES)
ALLOW_ENV = "PREFIX_SHARING_ALLOW_MCORE"


class UnsupportedMegatronRelease(MissingPackageError):
    """The installed megatron-core is not a release this package is tested on (an
    ``ImportError``, and bad input: the command prints it as one line)."""


def installed_release() -> str:
    """The installed megatron-core version (the package's metadata, else megatron's own)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # e.g. a Megatron-LM checkout on the path
        from megatron.core import package_info

        return package_info.__version__


def check_release(version: str | None = None) -> None:
    """Raises unless ``version`` (default: the installed one) is a tested release or is named
    by ``PREFIX_SHARING_ALLOW_MCORE``, in which case it warns once.

    Raises:
        UnsupportedMegatronRelease: naming the tested releases and the override.
    """
    version = installed_release() if version is None else version
    if version in TESTED_RELEASES:
        return
    allowed = os.environ.get(ALLOW_ENV, "").strip()
    if allowed == version:
        warnings.warn(
            f"prefix-sharing: running on megatron-core {version}, which it is not tested on "
            f"(tested: {', '.join(TESTED_RELEASES)}), because {ALLOW_ENV}={version}; a layer "
            "form it does not know raises, but results are not verified on this release",
            stacklevel=2,
        )
        return
    named = f" ({ALLOW_ENV}={allowed!r} names another version)" if allowed else ""
    raise UnsupportedMegatronRelease(
        f"prefix_sharing.megatron_ext is tested on megatron-core {', '.join(TESTED_RELEASES)}; "
        f"megatron-core {version} is installed{named}. Install a tested release (Python 3.10/3.11: "
        f"megatron-core==0.16.1; Python 3.12+: megatron-core==0.19.2), or set "
        f"{ALLOW_ENV}={version} to run on it anyway"
    )
