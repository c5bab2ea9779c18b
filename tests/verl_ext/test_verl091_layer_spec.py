"""The sharing engine builds its model with the prefix-sharing layer spec, through the hook of
either bridge verl 0.9.1 uses: Megatron-Bridge's ``provider.transformer_layer_spec`` (a spec or a
factory whose signature Megatron-Bridge inspects for ``vp_stage``) and the vanilla mbridge's
``_get_transformer_layer_spec``. Stand-in bridge objects: Megatron-Bridge needs CUDA TE to build."""

import inspect
from types import SimpleNamespace

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402

from prefix_sharing.megatron_ext import PrefixSharingCoreAttention  # noqa: E402
from prefix_sharing.verl_ext.mcore_engine import install_layer_spec  # noqa: E402


def _shares(layer_spec) -> bool:
    core = layer_spec.submodules.self_attention.submodules.core_attention
    return getattr(core, "module", core) is PrefixSharingCoreAttention  # a spec, or the class


def test_megatron_bridge_provider_factory_keeps_its_signature():
    def factory(config, vp_stage=None):
        return TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec()] * 2)

    engine = SimpleNamespace(provider=SimpleNamespace(transformer_layer_spec=factory))
    install_layer_spec(engine)
    hook = engine.provider.transformer_layer_spec
    assert "vp_stage" in inspect.signature(hook).parameters
    block = hook(None, vp_stage=0)
    assert all(_shares(layer) for layer in block.layer_specs)
    assert not _shares(factory(None).layer_specs[0])  # the stock factory is left as it was


def test_megatron_bridge_provider_plain_spec_and_vanilla_mbridge():
    engine = SimpleNamespace(provider=SimpleNamespace(transformer_layer_spec=get_gpt_layer_local_spec()))
    install_layer_spec(engine)
    assert _shares(engine.provider.transformer_layer_spec)

    engine = SimpleNamespace(provider=None, bridge=SimpleNamespace(
        _get_transformer_layer_spec=lambda vp_stage=None: get_gpt_layer_local_spec()))
    install_layer_spec(engine)
    assert _shares(engine.bridge._get_transformer_layer_spec(vp_stage=None))
