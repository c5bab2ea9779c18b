"""verl's VeOmni engines refuse sharing by name at construction, and build as verl's own
without it (``prefix_sharing.verl_ext.veomni``).

verl's VeOmni module imports the ``veomni`` package, which is not installed here (nor
installable into the test environments), so the hook runs on a stand-in of that module: its two
engine classes registered in verl's real ``EngineRegistry`` under the ``veomni`` backend, as
verl's decorators register them. ``prefix-sharing preflight`` gives the same verdict through the
same classmethod (``test_preflight``)."""

import importlib.util
import types

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)


@pytest.fixture
def stand_in():
    """A stand-in of ``verl.workers.engine.veomni.transformer_impl`` whose engines record their
    construction, registered for cuda; the registry is put back afterwards."""
    from verl.workers.engine.base import BaseEngine, EngineRegistry

    from prefix_sharing.verl_ext.veomni import ENGINE_MODULE, ENGINES

    module = types.ModuleType(ENGINE_MODULE)
    saved = {model_type: dict(backends) for model_type, backends in EngineRegistry._engines.items()}
    for name, model_type in zip(ENGINES, ("language_model", "value_model")):
        def __init__(self, model_config, engine_config, *args, **kwargs):
            self.built_from = (model_config, engine_config)

        stock = type(name, (BaseEngine,), {"__init__": __init__, "__module__": ENGINE_MODULE})
        EngineRegistry._engines.setdefault(model_type, {})["veomni"] = {"cuda": stock}
        setattr(module, name, stock)
    try:
        yield module
    finally:
        EngineRegistry._engines.clear()
        EngineRegistry._engines.update(saved)


def test_a_veomni_engine_asked_to_share_refuses_by_name_and_builds_without(stand_in):
    from prefix_sharing.config import PrefixSharingConfig
    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.config import ATTRIBUTE
    from prefix_sharing.verl_ext.engine import registered_engine
    from prefix_sharing.verl_ext.veomni import patch_engine

    patch_engine(stand_in)
    for model_type in ("language_model", "value_model"):
        engine_cls = registered_engine(model_type, "veomni")
        assert engine_cls.__name__.startswith("PrefixSharingRefusedVeOmniEngineWith")
        asks = types.SimpleNamespace(**{ATTRIBUTE: PrefixSharingConfig(mode="prompt_only")})
        with pytest.raises(PrefixSharingSetupError, match=r"model_engine=fsdp.*\[verl\.veomni\]"):
            engine_cls(types.SimpleNamespace(), asks)
        plain = types.SimpleNamespace()  # no sharing request: verl's own engine, built
        assert engine_cls(types.SimpleNamespace(), plain).built_from[1] is plain
