"""verl's MindSpeed engine (Ascend) becomes the prefix-sharing engine, and the prefix-sharing
MindSpeed feature is registered before verl's own ``repatch`` so that the repatch applies it.

Needs a verl environment (``.ci/verl_env.sh 0.9.1`` or ``0.8.0``); MindSpeed is
``fake_mindspeed``. Runs in a spawned rank: importing MindSpeed patches megatron-core for the
rest of the process.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build its environment: .ci/verl_env.sh 0.9.1 or 0.8.0)",
                allow_module_level=True)

from prefix_sharing import PrefixSharingConfig

from ..megatron_ext._distributed import run_distributed
from . import fake_mindspeed


class _EngineConfig(dict):
    """What verl's ``_mindspeed_repatch`` reads: ``.get(...)`` and ``.context_parallel_size``."""

    context_parallel_size = 1


def _engine_job(rank: int, mode: str) -> dict:
    fake_mindspeed.install(pytest.MonkeyPatch())
    from prefix_sharing.verl_ext import installed
    from tests.verl_ext import _engine  # noqa: F401 - imports verl's Megatron engine on CPU

    import verl.workers.engine.mindspeed.transformer_impl as mindspeed_impl
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from verl.workers.engine.megatron import transformer_impl as megatron_impl

    from prefix_sharing.verl_ext.engine import registered_engine

    engine = registered_engine("language_model", "megatron", "npu", "huawei")
    events = []
    repatch = mindspeed_impl.repatch

    def recording_repatch(args):
        events.append(("repatch", [f.feature_name for f in MindSpeedFeaturesManager.FEATURES_LIST]))
        repatch(args)

    mindspeed_impl.repatch = recording_repatch
    megatron_impl.MegatronEngineWithLMHead._init_device_mesh = lambda self: events.append(("mesh",))
    instance = object.__new__(engine)
    instance.prefix_sharing = PrefixSharingConfig(mode=mode)
    instance.engine_config = _EngineConfig(override_transformer_config={})
    instance._init_device_mesh()
    return {
        "engine": engine.__name__,
        "bases": [c.__name__ for c in engine.__mro__[1:3]],
        "patchsets": installed(),
        "events": events,
        # the feature's guard wraps MindSpeed's fused attention
        "guarded": getattr(DotProductAttention.forward, "__wrapped__", None)
        is fake_mindspeed.fused_attention_forward,
    }


def _context_parallel_job(rank: int) -> dict:
    """verl's repatch with ``context_parallel_size=2`` (MindSpeed's default algorithm, then
    ``override_transformer_config.context_parallel_algo=ulysses_cp_algo``)."""
    fake_mindspeed.install(pytest.MonkeyPatch())
    from tests.verl_ext import _engine  # noqa: F401 - imports verl's Megatron engine on CPU

    from megatron.core.transformer import dot_product_attention
    from verl.workers.engine.megatron import transformer_impl as megatron_impl

    from prefix_sharing.verl_ext.engine import registered_engine

    megatron_impl.MegatronEngineWithLMHead._init_device_mesh = lambda self: None
    engine = registered_engine("language_model", "megatron", "npu", "huawei")
    report = {}
    for name, override in (("megatron_cp_algo", {}),
                           ("ulysses_cp_algo", {"context_parallel_algo": "ulysses_cp_algo"})):
        instance = object.__new__(engine)
        instance.prefix_sharing = PrefixSharingConfig(mode="arbitrary_prefix")
        instance.engine_config = _EngineConfig(override_transformer_config=override)
        instance.engine_config.context_parallel_size = 2
        try:
            instance._init_device_mesh()
            report[name] = ("ok", dot_product_attention.DotProductAttention.__name__)
        except Exception as err:  # noqa: BLE001 - the type is checked by the test
            report[name] = (type(err).__name__, str(err))
    return report


@pytest.fixture(scope="module")
def runs():
    return {mode: run_distributed(_engine_job, 1, mode, timeout=300)[0]
            for mode in ("arbitrary_prefix", "off")}


def test_the_npu_engine_is_the_mindspeed_engine_on_the_prefix_sharing_engine(runs):
    run = runs["arbitrary_prefix"]
    assert run["engine"] == "PrefixSharingMindspeedEngine"
    assert run["bases"] == ["MindspeedEngineWithLMHead", "PrefixSharingMegatronEngine"]
    assert any(name.endswith("_mcore_mindspeed") for name in run["patchsets"])


def test_the_feature_is_listed_before_verls_repatch_and_applied_by_it(runs):
    run = runs["arbitrary_prefix"]
    (kind, features), mesh = run["events"]
    assert kind == "repatch" and "prefix_sharing" in features
    assert mesh == ("mesh",)  # verl's own device-mesh setup still runs, after the repatch
    assert run["guarded"]


def test_with_sharing_off_mindspeed_is_left_as_verl_runs_it(runs):
    run = runs["off"]
    (kind, features), _ = run["events"]
    assert "prefix_sharing" not in features and not run["guarded"]


def test_context_parallel_through_verls_repatch_keeps_the_ring_algorithm_and_refuses_ulysses():
    report = run_distributed(_context_parallel_job, 1, timeout=300)[0]
    assert report["megatron_cp_algo"] == ("ok", "MindSpeedCPDotProductAttention")
    kind, message = report["ulysses_cp_algo"]
    assert kind == "UnsupportedSetupError" and "--context-parallel-algo ulysses_cp_algo" in message
