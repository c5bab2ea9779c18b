"""Module-level skip for tests written against one verl release."""

import importlib.util
from importlib.metadata import version

import pytest


def require_verl(release: str) -> None:
    if importlib.util.find_spec("verl") is None:
        pytest.skip(f"verl is not installed (build its environment: .ci/verl_env.sh {release})",
                    allow_module_level=True)
    if version("verl") != release:
        pytest.skip(f"written for verl {release}; verl {version('verl')} is installed",
                    allow_module_level=True)
