"""Importing the Megatron adapter on an untested megatron-core release raises, unless the
environment names that release (then it warns once)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from prefix_sharing.megatron_ext import release
from prefix_sharing.megatron_ext.release import (
    ALLOW_ENV,
    TESTED_RELEASES,
    UnsupportedMegatronRelease,
    check_release,
)

pytestmark = pytest.mark.mcore_release_check


def test_the_installed_release_is_a_tested_one():
    assert release.installed_release() in TESTED_RELEASES


@pytest.mark.parametrize("version", ["0.15.0", "0.16.0", "0.19.3", "0.20.0rc0"])
def test_untested_release_is_refused_naming_the_tested_ones(version, monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedMegatronRelease) as raised:
        check_release(version)
    message = str(raised.value)
    assert f"megatron-core {version} is installed" in message
    assert all(tested in message for tested in TESTED_RELEASES)
    assert f"{ALLOW_ENV}={version}" in message
    assert isinstance(raised.value, ImportError)


def test_naming_the_release_forces_it_with_a_warning(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "0.20.0")
    with pytest.warns(UserWarning, match=r"megatron-core 0\.20\.0, which it is not tested on"):
        check_release("0.20.0")


def test_naming_another_release_does_not_force_this_one(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "0.20.0")
    with pytest.raises(UnsupportedMegatronRelease, match=r"names another version"):
        check_release("0.20.1")


def _import_with_version(version: str, **env: str) -> subprocess.CompletedProcess:
    """Imports the package in a fresh interpreter whose megatron-core reports ``version``."""
    code = textwrap.dedent(f"""
        import importlib.metadata, warnings
        real = importlib.metadata.version
        importlib.metadata.version = (
            lambda name: {version!r} if name == "megatron-core" else real(name))
        warnings.simplefilter("always")
        import prefix_sharing.megatron_ext
        print("imported")
    """)
    environ = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environ, **env})


def test_import_refuses_and_forces():
    refused = _import_with_version("0.99.0")
    assert refused.returncode != 0
    assert "UnsupportedMegatronRelease: prefix_sharing.megatron_ext is tested on" in refused.stderr
    forced = _import_with_version("0.99.0", **{ALLOW_ENV: "0.99.0"})
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == "imported"
    assert forced.stderr.count("which it is not tested on") == 1
