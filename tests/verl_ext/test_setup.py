"""The prototype README's integration commands, verbatim, against this project's verl patches.

"Integrating PrefixSharing" there reads::

    PREFIX_SHARING_PATCHSET=verl080_fsdp python your_verl_entry.py
    PREFIX_SHARING_PATCHSET=verl080_fsdp,verl080_mcore0161_ms0160 python your_verl_entry.py

and offers ``prefix_sharing.setup.install(...)`` programmatically. Each case runs those command
lines through ``bash`` in a fresh interpreter (the names are read at import) with an entry
script that imports ``prefix_sharing`` and verl's engines and reports what got patched: the
named sets are applied, nothing else. Runs with either supported verl (``.venv-verl091``,
``.venv-verl080``); naming a 0.8.0 set on verl 0.9.1 adds one warning that says so.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from importlib.metadata import version  # noqa: E402

VERL = version("verl")

# your_verl_entry.py: what a verl entry point does first, then a report of verl's state.
ENTRY = """
import json
import prefix_sharing
{setup}
import verl.workers.engine  # every engine, as verl's workers import them
from verl.workers.config import FSDPActorConfig, McoreActorConfig
from prefix_sharing.verl_ext.engine import registered_engine
print(json.dumps(dict(
    installed=prefix_sharing.setup.installed(),
    engines=[registered_engine("language_model", backend, *device).__name__
             for backend, device in (("megatron", ("cuda", "nvidia")), ("megatron", ("npu", "huawei")),
                                     ("fsdp", ("cuda", "nvidia")))],
    accepts=[any(f == "prefix_grouper" for f in c.__dataclass_fields__)
             for c in (McoreActorConfig, FSDPActorConfig)])))
"""

STOCK = ["MegatronEngineWithLMHead", "MindspeedEngineWithLMHead", "FSDPEngineWithLMHead"]


def _run(tmp_path: Path, command: str, setup: str = "") -> subprocess.CompletedProcess:
    (tmp_path / "your_verl_entry.py").write_text(ENTRY.format(setup=setup))
    environ = {k: v for k, v in os.environ.items()
               if k not in ("ENABLE_PREFIX_SHARING", "PREFIX_SHARING_PATCHSET")}
    path = f"{Path(sys.executable).parent}:{environ.get('PATH', '')}"  # `python`: this one
    pythonpath = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                               environ.get("PYTHONPATH")]))
    return subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**environ, "PATH": path, "PYTHONPATH": pythonpath,
                                            "OMP_NUM_THREADS": "1"})


def _report(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _warnings(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if "prefix-sharing: patch set" in line]


# What a name for verl 0.8.0 adds to the warning on verl 0.9.1.
VERL_DIFFERENCE = [] if VERL == "0.8.0" else [f"verl 0.8.0 (installed: {VERL})"]


def test_the_fsdp_set_alone(tmp_path):
    out = _run(tmp_path, "PREFIX_SHARING_PATCHSET=verl080_fsdp python your_verl_entry.py")
    assert _report(out) == dict(installed=["verl080_fsdp"],
                                engines=STOCK[:2] + ["PrefixSharingFSDPEngine"],
                                accepts=[False, True])
    assert [w.split("prefix-sharing: ")[1] for w in _warnings(out)] == [
        f"patch set verl080_fsdp is for {d}; applying verl080_fsdp anyway"
        for d in VERL_DIFFERENCE]


def test_the_fsdp_set_and_the_megatron_set_named_after_its_stack(tmp_path):
    out = _run(tmp_path, "PREFIX_SHARING_PATCHSET=verl080_fsdp,verl080_mcore0161_ms0160 "
                         "python your_verl_entry.py")
    assert _report(out) == dict(
        installed=["verl080_fsdp", "verl080_mcore", "verl080_mcore_mindspeed"],
        engines=["PrefixSharingMegatronEngine", "PrefixSharingMindspeedEngine",
                 "PrefixSharingFSDPEngine"],
        accepts=[True, True])
    # megatron-core 0.16.1 is installed; MindSpeed is not (and verl may be 0.9.1): one warning
    # for the name that states them, none for the one that matches.
    warnings = _warnings(out)
    assert len(warnings) == 1 + len(VERL_DIFFERENCE), warnings
    differences = VERL_DIFFERENCE + ["MindSpeed core_r0.16.0 (installed: none)"]
    assert warnings[-1].endswith(
        f"patch set verl080_mcore0161_ms0160 is for {', '.join(differences)}; "
        "applying verl080_mcore + verl080_mcore_mindspeed anyway")


def test_programmatic_install_narrows_import_time_activation(tmp_path):
    out = _run(tmp_path, "python your_verl_entry.py",
               setup='prefix_sharing.setup.install("verl080_fsdp")')
    assert _report(out)["installed"] == ["verl080_fsdp"]


def test_setup_install_is_the_one_install():
    import prefix_sharing
    from prefix_sharing import verl_ext

    assert prefix_sharing.setup.install is verl_ext.install


def test_an_unknown_name_raises_with_the_known_names(tmp_path):
    out = _run(tmp_path, "PREFIX_SHARING_PATCHSET=verl080_mcore0150 python your_verl_entry.py")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "unknown verl patch set(s) ['verl080_mcore0150']; known: [" in last
    assert "'verl080_mcore0161_ms0160'" in last and "'verl091_mcore0192'" in last
    assert "'verl091_mcore'" in last


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="megatron-core 0.19.2 exists on 3.12")
def test_a_name_for_a_stack_that_cannot_exist_here_raises(tmp_path):
    release = VERL.replace(".", "")
    out = _run(tmp_path,
               f"PREFIX_SHARING_PATCHSET=verl{release}_mcore0192 python your_verl_entry.py")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert f"names verl{release}_mcore0192, a stack that cannot be this one: megatron-core " \
           "0.19.2 needs Python >= 3.12" in last
    assert f"For this stack: verl{release}_fsdp, verl{release}_mcore0161" in last
