"""Module-level skip for tests written against one verl release."""

import importlib.util
from importlib.metadata import version

import pytest


def require_verl(release: str | tuple[str, ...]) -> None:
    """Skips the module unless verl is installed at ``release`` (or one of several)."""
    releases = (release,) if isinstance(release, str) else release
    if importlib.util.find_spec("verl") is None:
        pytest.skip(f"verl is not installed (build its environment: .ci/verl_env.sh {releases[0]})",
                    allow_module_level=True)
    if version("verl") not in releases:
        pytest.skip(f"written for verl {' / '.join(releases)}; verl {version('verl')} is installed",
                    allow_module_level=True)
