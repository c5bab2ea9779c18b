"""verl's engines prefix sharing does not hook (VeOmni, AutoModel, TorchTitan) refuse sharing by
name at construction, and build as verl's own without it (``prefix_sharing.verl_ext.unhooked``).

verl's modules of these engines import their own packages (``veomni``, ``nemo_automodel``,
``torchtitan``), which are not installed here (nor installable into the test environments), so
the hook runs on a stand-in of each module: its engine classes registered in verl's real
``EngineRegistry`` under the engine's backend, as verl's decorators register them.
``prefix-sharing preflight`` gives the same verdict through the same classmethod
(``test_preflight``, ``test_verl_recipes``)."""

import importlib.util
import types

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.verl_ext.unhooked import UNHOOKED  # noqa: E402


@pytest.fixture
def stand_in(request):
    """A stand-in of the backend's verl module whose engines record their construction,
    registered for cuda; the registry is put back afterwards."""
    from verl.workers.engine.base import BaseEngine, EngineRegistry

    backend = request.param
    unhooked = UNHOOKED[backend]
    module = types.ModuleType(unhooked.module)
    saved = {model_type: dict(backends) for model_type, backends in EngineRegistry._engines.items()}
    for name in unhooked.engines:
        def __init__(self, model_config, engine_config, *args, **kwargs):
            self.built_from = (model_config, engine_config)

        stock = type(name, (BaseEngine,), {"__init__": __init__, "__module__": unhooked.module})
        model_type = "value_model" if name.endswith("ValueHead") else "language_model"
        EngineRegistry._engines.setdefault(model_type, {})[backend] = {"cuda": stock}
        setattr(module, name, stock)
    try:
        yield backend, module
    finally:
        EngineRegistry._engines.clear()
        EngineRegistry._engines.update(saved)


@pytest.mark.parametrize("stand_in", list(UNHOOKED), indirect=True)
def test_an_unhooked_engine_asked_to_share_refuses_by_name_and_builds_without(stand_in):
    from prefix_sharing.config import PrefixSharingConfig
    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.config import ATTRIBUTE
    from prefix_sharing.verl_ext.engine import registered_engine
    from prefix_sharing.verl_ext.unhooked import patch_engine, refusal_for

    backend, module = stand_in
    patch_engine(module, backend)
    patch_engine(module, backend)  # a second import's hook changes nothing
    for name in UNHOOKED[backend].engines:
        model_type = "value_model" if name.endswith("ValueHead") else "language_model"
        engine_cls = registered_engine(model_type, backend)
        assert engine_cls.__name__ == f"PrefixSharingRefused{name}"
        asks = types.SimpleNamespace(**{ATTRIBUTE: PrefixSharingConfig(mode="prompt_only")})
        with pytest.raises(PrefixSharingSetupError, match=rf"{backend}.*\[verl\.unhooked_engine\]"):
            engine_cls(types.SimpleNamespace(), asks)
        plain = types.SimpleNamespace()  # no sharing request: verl's own engine, built
        assert engine_cls(types.SimpleNamespace(), plain).built_from[1] is plain
        # what preflight asks is the same check
        assert [p.key for p in refusal_for(backend).setup_problems(None, asks)] == [
            "verl.unhooked_engine"]


def test_the_unhooked_engines_are_the_ones_verl_registers_beside_fsdp_and_megatron():
    """Every backend verl registers whose engines are not this project's sharing ones is in
    the table (verl's engine package names each in its optional imports)."""
    import os

    import verl.workers.engine as engines

    packages = {name for name in os.listdir(os.path.dirname(engines.__file__))
                if os.path.isdir(os.path.join(os.path.dirname(engines.__file__), name))
                and not name.startswith("__")}
    assert packages - {"fsdp", "megatron", "mindspeed"} <= set(UNHOOKED)
