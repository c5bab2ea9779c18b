"""Nothing stays stock while sharing, whatever form this megatron-core release gives a spec.

Every spec form the release offers without Transformer Engine - the local layer spec, dense and
MoE (a ``ModuleSpec`` MoE up to 0.17, a ``functools.partial`` from 0.18), the list of
``get_gpt_decoder_layer_specs`` and the ``TransformerBlockSubmodules`` of
``get_gpt_decoder_block_spec`` with dense and MoE layers mixed - comes back with the sharing
self-attention and core attention in every layer, and the sharing router and layer class in
every MoE layer; a form it does not know raises, naming the layer. A model built from a stock
spec (or a stock module slipped in) refuses to run a plan.

The Transformer Engine builders need TE even to build the spec on these releases (0.16.1 raises
NameError, 0.19.2 TypeError), so they are covered by the same functions on a TE machine only.
"""

from __future__ import annotations

import functools

import pytest
from megatron.core.models.gpt import gpt_layer_specs as stock
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from prefix_sharing.megatron_ext import (
    PrefixSharingCoreAttention,
    PrefixSharingRouter,
    PrefixSharingSelfAttention,
    PrefixSharingTransformerLayer,
    UnsupportedSetupError,
    UnsupportedSpecError,
    check_sharing_model,
    with_prefix_sharing,
)

from ._distributed import run_distributed

pytestmark = pytest.mark.mcore_release_check

MOE_PATTERN = [1, 0, 1, 0]  # layers 1 and 3 MoE


def _mlp_parts(mlp):
    """(class built, submodules) of an mlp spec in either form."""
    if isinstance(mlp, ModuleSpec):
        return mlp.module, mlp.submodules
    assert isinstance(mlp, functools.partial), f"unexpected mlp form {mlp!r}"
    func = mlp.func
    return getattr(func, "__self__", func), mlp.keywords.get("submodules")


def assert_layer_shares(layer, moe: bool) -> None:
    """The layer spec has every sharing swap, and is MoE exactly when ``moe``."""
    attention = layer.submodules.self_attention
    assert attention.module is PrefixSharingSelfAttention
    assert attention.submodules.core_attention.module is PrefixSharingCoreAttention
    built, submodules = _mlp_parts(layer.submodules.mlp)
    assert issubclass(built, BaseMoELayer) == moe
    if moe:
        assert layer.module is PrefixSharingTransformerLayer
        assert submodules.router is PrefixSharingRouter
    else:
        assert layer.module is TransformerLayer


def test_moe_layer_spec_form_of_this_release_is_swapped():
    """The MoE mlp form this release uses (recorded, so the report shows which form ran)."""
    theirs = stock.get_gpt_layer_local_spec(num_experts=4)
    ours = with_prefix_sharing(theirs)
    assert_layer_shares(ours, moe=True)
    assert type(ours.submodules.mlp) is type(theirs.submodules.mlp)
    assert _mlp_parts(theirs.submodules.mlp)[1].router is TopKRouter  # the input is untouched


@pytest.mark.parametrize("kwargs", [{}, dict(normalization="RMSNorm", qk_layernorm=True)])
def test_dense_layer_spec_is_swapped(kwargs):
    assert_layer_shares(with_prefix_sharing(stock.get_gpt_layer_local_spec(**kwargs)), moe=False)


def test_sharing_twice_is_sharing_once():
    once = with_prefix_sharing(stock.get_gpt_layer_local_spec(num_experts=4))
    assert_layer_shares(with_prefix_sharing(once), moe=True)


def _block_forms(rank: int) -> dict:
    """In a rank (the block builder reads the pipeline layout): the decoder layer list and
    block spec of a 4-layer model with MoE in layers 1 and 3, before and after sharing; and the
    sharing check on models built stock, shared, and shared with one stock router slipped in."""
    from megatron.core.transformer import TransformerConfig

    from prefix_sharing.engines.megatron import gpt_model
    from prefix_sharing.presets import PRESETS

    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4,
                               num_moe_experts=4, moe_layer_freq=list(MOE_PATTERN),
                               moe_aux_loss_coeff=0.0)
    block = stock.get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                             normalization="RMSNorm")
    layers = stock.get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                               normalization="RMSNorm")
    out = {"block": block, "shared_block": with_prefix_sharing(block),
           "shared_layers": with_prefix_sharing(layers)}

    preset = PRESETS["tiny-moe"]
    shared_block = with_prefix_sharing(stock.get_gpt_decoder_block_spec(
        gpt_model(preset, layout="padded").config, use_transformer_engine=False,
        normalization="RMSNorm"))
    checks = {}
    for name, spec in [("stock", None), ("shared", shared_block)]:
        model = gpt_model(preset, layout="padded", layer_spec=spec)
        try:
            check_sharing_model(model)
            checks[name] = "ok"
        except UnsupportedSetupError as error:
            checks[name] = str(error)
    model = gpt_model(preset, layer_spec=shared_block)
    model.decoder.layers[0].mlp.router.__class__ = TopKRouter  # a stock router slipped in
    try:
        check_sharing_model([model])
        checks["slipped"] = "ok"
    except UnsupportedSetupError as error:
        checks["slipped"] = str(error)
    out["checks"] = checks
    return out


@pytest.fixture(scope="module")
def block_forms() -> dict:
    return run_distributed(_block_forms, 1)[0]


def test_decoder_block_spec_shares_every_layer(block_forms):
    shared = block_forms["shared_block"]
    assert isinstance(shared, TransformerBlockSubmodules)
    assert shared.layer_norm is block_forms["block"].layer_norm
    assert len(shared.layer_specs) == len(MOE_PATTERN)
    for layer, moe in zip(shared.layer_specs, MOE_PATTERN):
        assert_layer_shares(layer, moe=bool(moe))
    for layer in block_forms["block"].layer_specs:  # the stock block is left alone
        assert layer.submodules.self_attention.module is not PrefixSharingSelfAttention


def test_decoder_layer_list_shares_every_layer(block_forms):
    layers = block_forms["shared_layers"]
    assert isinstance(layers, list) and len(layers) == len(MOE_PATTERN)
    for layer, moe in zip(layers, MOE_PATTERN):
        assert_layer_shares(layer, moe=bool(moe))


def test_model_with_stock_modules_refuses_a_plan(block_forms):
    checks = block_forms["checks"]
    assert checks["shared"] == "ok"
    assert "decoder.layers.0.self_attention (SelfAttention)" in checks["stock"]
    assert "decoder.layers.0.mlp.router (TopKRouter)" in checks["stock"]
    assert "decoder.layers.0.mlp.router (TopKRouter)" in checks["slipped"]
    assert "self_attention" not in checks["slipped"]


def test_unrecognised_layer_form_is_refused_naming_the_layer():
    layers = [stock.get_gpt_layer_local_spec(),
              functools.partial(TransformerLayer, submodules=None)]
    with pytest.raises(UnsupportedSpecError, match=r"not a TransformerLayer ModuleSpec \(layer 2 "
                                                   r"is partial\(TransformerLayer\)\)"):
        with_prefix_sharing(layers)


def test_unrecognised_spec_type_is_refused():
    with pytest.raises(UnsupportedSpecError, match=r"does not recognise \(a spec of type dict\)"):
        with_prefix_sharing({"layer": stock.get_gpt_layer_local_spec()})


def test_mlp_whose_module_cannot_be_told_is_refused():
    spec = stock.get_gpt_layer_local_spec()
    spec.submodules.mlp = lambda **kwargs: None
    with pytest.raises(UnsupportedSpecError,
                       match="the layer spec has mlp=.*can tell whether its router must be"):

        with_prefix_sharing(spec)


def test_moe_with_another_router_is_refused():
    spec = stock.get_gpt_layer_local_spec(num_experts=4)
    mlp = spec.submodules.mlp
    submodules = _mlp_parts(mlp)[1]
    submodules.router = type("CustomRouter", (TopKRouter,), {})
    with pytest.raises(UnsupportedSpecError, match="MoE router is CustomRouter"):
        with_prefix_sharing(spec)


def test_an_attention_it_does_not_know_is_refused_naming_the_layer():
    from megatron.core.transformer.attention import CrossAttention

    layers = [stock.get_gpt_layer_local_spec(),
              stock.get_gpt_layer_local_spec(multi_latent_attention=True),
              stock.get_gpt_layer_local_spec()]
    layers[2].submodules.self_attention.module = CrossAttention
    with pytest.raises(UnsupportedSpecError, match=r"layer 3 has self_attention=ModuleSpec\("
                                                   "CrossAttention"):
        with_prefix_sharing(layers)


def test_a_registered_form_is_converted_by_its_swap(monkeypatch):
    from prefix_sharing.megatron_ext import layer_specs

    monkeypatch.setattr(layer_specs, "_FORMS", [])

    class Stack:
        def __init__(self, layers):
            self.layers = layers

    layer_specs.register_spec_form(lambda spec: isinstance(spec, Stack),
                                   lambda spec: Stack(with_prefix_sharing(spec.layers)))
    shared = with_prefix_sharing(Stack([stock.get_gpt_layer_local_spec(num_experts=4)]))
    assert_layer_shares(shared.layers[0], moe=True)
