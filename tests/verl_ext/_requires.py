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


def on_release(release: str, why: str) -> pytest.MarkDecorator:
    """Runs the test on one verl release only: CI runs every supported release in its own
    environment, so the test still runs once; a trainer run takes minutes, and CI's time is
    split between the releases. ``why``: what covers the other release."""
    installed = version("verl") if importlib.util.find_spec("verl") else None
    return pytest.mark.skipif(installed != release,
                              reason=f"runs on verl {release} only (CI time): {why}")
