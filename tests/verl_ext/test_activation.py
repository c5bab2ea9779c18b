"""How the verl patches switch on: at import, in either import order, narrowed, or off.

Each case runs in a fresh interpreter: activation is process-wide and happens at import.
"""

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

# What a process reports about verl's state: which patch sets ran, which engine class is
# registered, whether the actor config accepts prefix_grouper, whether the forward-fn lookup is wrapped.
PROBE = """
import json
import verl.workers.engine.megatron.transformer_impl as ti
import verl.models.mcore as mcore
from verl.workers.config import McoreActorConfig
import prefix_sharing.verl_ext as ve
from prefix_sharing.verl_ext.engine import registered_engine
engine = registered_engine("language_model", "megatron")
print(json.dumps(dict(
    installed=ve.installed(), enabled=ve.activation.enabled(), engine=engine.__name__,
    accepts=any(f == "prefix_grouper" for f in McoreActorConfig.__dataclass_fields__),
    wrapped=getattr(mcore.get_mcore_engine_forward_fn, "_prefix_sharing", False))))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("ENABLE_PREFIX_SHARING", "PREFIX_SHARING_PATCHSET",
                            "VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environ, "OMP_NUM_THREADS": "1", **env}, timeout=300)


def _probe(first: str, **env: str) -> dict:
    out = _run(first + "\n" + PROBE, **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _patched(got: dict) -> bool:
    return (got["engine"] == "PrefixSharingMegatronEngine" and got["accepts"] and got["wrapped"]
            and got["enabled"] and "verl091_mcore" in got["installed"])


def test_importing_prefix_sharing_before_verl_patches_it():
    assert _patched(_probe("import prefix_sharing"))


def test_importing_it_after_verl_through_verls_plugin_route_patches_it_once():
    # verl's worker imports model.external_lib by name, after verl itself; install() again is a
    # no-op.
    code = ("import verl.workers.engine.megatron.transformer_impl, verl.workers.config\n"
            "from verl.utils.import_utils import import_external_libs\n"
            "import_external_libs('prefix_sharing')\n"
            "import prefix_sharing.verl_ext as ve\nve.install(); ve.install()")
    assert _patched(_probe(code))


def test_verls_external_modules_variable_reaches_every_process_that_imports_verl():
    # VERL_USE_EXTERNAL_MODULES is read in verl/__init__, in the driver and each Ray worker
    # (verl 0.8.0's route; plugin discovery off here, so the variable alone loads it).
    assert _patched(_probe("import verl", VERL_USE_EXTERNAL_MODULES="prefix_sharing",
                           VERL_USE_EXTERNAL_PLUGINS="none"))


# What `import verl` alone leaves behind, before this process imports prefix_sharing itself:
# whether verl's plugin discovery loaded it, and the engines verl's own lookup selects on an
# NVIDIA GPU (VERL_ENGINE_DEVICE / VERL_ENGINE_VENDOR below).
PLUGIN_PROBE = """
import json, sys
import verl
loaded = "prefix_sharing" in sys.modules
import verl.workers.engine
from verl.workers.config import FSDPActorConfig
from verl.workers.engine.base import EngineRegistry
print(json.dumps(dict(
    loaded=loaded,
    engines=[EngineRegistry.get_engine_cls("language_model", backend).__name__
             for backend in ("fsdp", "fsdp2", "megatron")],
    accepts="prefix_grouper" in FSDPActorConfig.__dataclass_fields__)))
"""
SHARING_ENGINES = ["PrefixSharingFSDPEngine", "PrefixSharingFSDPEngine",
                   "PrefixSharingMegatronEngine"]
STOCK_ENGINES = ["FSDPEngineWithLMHead", "FSDPEngineWithLMHead", "MegatronEngineWithLMHead"]


def _plugin_probe(**env: str) -> dict:
    plugins = [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "prefix_sharing"]
    assert plugins == ["prefix_sharing.verl_ext.plugin"], (
        "the verl.plugins entry point is not in this environment's metadata: install the project "
        "(pip install -e . --no-deps), as .ci/verl_env.sh does")
    out = _run(PLUGIN_PROBE, VERL_ENGINE_DEVICE="cuda", VERL_ENGINE_VENDOR="nvidia", **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_installing_the_project_is_enough_verl_loads_it_as_a_plugin():
    # no VERL_USE_EXTERNAL_MODULES, no model.external_lib, no import prefix_sharing
    assert _plugin_probe() == dict(loaded=True, engines=SHARING_ENGINES, accepts=True)


def test_verls_plugin_switch_off_leaves_verl_stock():
    # the control: with verl's discovery off nothing loads it, and verl's engines stay
    assert _plugin_probe(VERL_USE_EXTERNAL_PLUGINS="none") == dict(
        loaded=False, engines=STOCK_ENGINES, accepts=False)


def test_enable_prefix_sharing_0_patches_only_the_config_acceptance():
    """verl's own engine and forward; the actor config accepts prefix_grouper, so the config
    that turns sharing on runs with the switch at 0 (tests/verl_ext/test_switched_off.py runs
    it). Loaded as verl's plugin (``import verl`` first), which reads the switch the same way."""
    got = _probe("import verl", ENABLE_PREFIX_SHARING="0")
    assert got == dict(installed=["verl091_fsdp", "verl091_mcore"], enabled=False,
                       engine="MegatronEngineWithLMHead", accepts=True, wrapped=False)


def test_enable_prefix_sharing_0_leaves_an_unsupported_verl_alone():
    got = _probe(UNSUPPORTED_VERL + "import prefix_sharing", ENABLE_PREFIX_SHARING="0")
    assert got == dict(installed=[], enabled=False, engine="MegatronEngineWithLMHead",
                       accepts=False, wrapped=False)


def test_patchset_variable_narrows_to_the_named_sets():
    got = _probe("import prefix_sharing", PREFIX_SHARING_PATCHSET="verl091_mcore")
    assert _patched(got) and got["installed"] == ["verl091_mcore"]


def test_an_unknown_patchset_name_is_refused():
    out = _run("import prefix_sharing\nimport verl.workers.config",
               PREFIX_SHARING_PATCHSET="verl999_nothing")
    assert out.returncode != 0
    assert "unknown verl patch set(s) ['verl999_nothing']" in out.stderr


# Makes the process see verl 0.7.1 (a release no patch set targets).
UNSUPPORTED_VERL = """
import dataclasses
import prefix_sharing.verl_ext.names as names
_stack = names.installed_stack
names.installed_stack = lambda: dataclasses.replace(_stack(), verl="0.7.1")
"""


def test_an_unsupported_verl_release_is_refused_with_the_override_named():
    out = _run(UNSUPPORTED_VERL + "import verl.workers.config")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "UnsupportedVerlVersion: prefix-sharing supports verl" in last
    assert "0.9.1" in last and "verl 0.7.1 is installed" in last
    assert "PREFIX_SHARING_PATCHSET=<name>" in last and "ENABLE_PREFIX_SHARING=0" in last


# Both engines at once: the Megatron and the FSDP patch sets hook two of the same modules
# (the actor configs' module, the micro-batch split's module).
BOTH_PROBE = """
import json
import verl.workers.engine.megatron.transformer_impl, verl.workers.engine.fsdp.transformer_impl
from verl.workers.config import FSDPActorConfig, McoreActorConfig
from verl.utils import seqlen_balancing
from verl.workers.engine import utils as engine_utils
import prefix_sharing.verl_ext as ve
from prefix_sharing.verl_ext.engine import registered_engine
split = engine_utils.rearrange_micro_batches
print(json.dumps(dict(
    installed=ve.installed(),
    engines=[registered_engine("language_model", backend).__name__
             for backend in ("megatron", "fsdp", "fsdp2")],
    accepts=[any(f == "prefix_grouper" for f in c.__dataclass_fields__)
             for c in (McoreActorConfig, FSDPActorConfig)],
    split_wraps_verls_own=getattr(split, "_prefix_sharing_stock", None)
    is seqlen_balancing.rearrange_micro_batches)))
"""


def test_the_megatron_and_fsdp_patch_sets_share_hooked_modules_in_one_process():
    got = _both("import prefix_sharing")
    assert {"verl091_fsdp", "verl091_mcore"} <= set(got.pop("installed"))
    assert got == dict(
        engines=["PrefixSharingMegatronEngine", "PrefixSharingFSDPEngine",
                 "PrefixSharingFSDPEngine"],
        accepts=[True, True], split_wraps_verls_own=True)


def test_patchset_variable_can_name_the_fsdp_set_alone():
    got = _both("import prefix_sharing", PREFIX_SHARING_PATCHSET="verl091_fsdp")
    assert got == dict(
        installed=["verl091_fsdp"],
        engines=["MegatronEngineWithLMHead", "PrefixSharingFSDPEngine", "PrefixSharingFSDPEngine"],
        accepts=[False, True], split_wraps_verls_own=True)


def _both(first: str, **env: str) -> dict:
    out = _run(first + "\n" + BOTH_PROBE, **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
