"""The layer specs are megatron-core's own, with exactly two submodules swapped (four in an MoE
layer: its router and the layer class too)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from megatron.core.models.gpt import gpt_layer_specs as stock
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from prefix_sharing.megatron_ext import (
    PrefixSharingCoreAttention,
    PrefixSharingMLASelfAttention,
    PrefixSharingRouter,
    PrefixSharingSelfAttention,
    PrefixSharingTransformerLayer,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    with_prefix_sharing,
)


def same_spec(a, b) -> bool:
    """Spec equality that also compares ``functools.partial`` forms (megatron-core 0.18+ MLP and
    MoE specs) by what they build, not by identity."""
    if isinstance(a, functools.partial):
        return (isinstance(b, functools.partial) and a.func == b.func and a.args == b.args
                and same_spec(a.keywords, b.keywords))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_spec(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same_spec(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def router_holder(spec):
    """The MoESubmodules of a layer spec's MoE mlp, in either form."""
    mlp = spec.submodules.mlp
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


def undo_swap(spec):
    """The spec with the two prefix-sharing submodules put back to the stock ones."""
    attention = spec.submodules.self_attention
    assert attention.module is PrefixSharingSelfAttention
    assert attention.submodules.core_attention.module is PrefixSharingCoreAttention
    attention.module = SelfAttention
    return attention


@pytest.mark.parametrize("kwargs", [
    {},
    dict(normalization="RMSNorm", qk_layernorm=True),
    dict(num_experts=4, moe_grouped_gemm=False),
])
def test_local_spec_is_the_stock_spec_but_for_attention(kwargs):
    ours, theirs = get_gpt_layer_local_spec(**kwargs), stock.get_gpt_layer_local_spec(**kwargs)
    attention = undo_swap(ours)
    attention.submodules.core_attention = theirs.submodules.self_attention.submodules.core_attention
    if kwargs.get("num_experts"):  # the router counts the plain batch, given the plan by the layer
        assert ours.module is PrefixSharingTransformerLayer
        assert router_holder(ours).router is PrefixSharingRouter
        ours.module = theirs.module
        router_holder(ours).router = router_holder(theirs).router
    assert same_spec(ours, theirs)


def test_with_prefix_sharing_copies_and_leaves_the_input_alone():
    base = stock.get_gpt_layer_local_spec()
    shared = with_prefix_sharing(base)
    assert base.submodules.self_attention.module is SelfAttention
    assert shared.submodules.self_attention.module is PrefixSharingSelfAttention


def test_multi_latent_attention_spec_gets_the_sharing_mla_and_core_attention():
    mla = stock.get_gpt_layer_local_spec(multi_latent_attention=True)
    attention = with_prefix_sharing(mla).submodules.self_attention
    assert attention.module is PrefixSharingMLASelfAttention
    assert attention.submodules.core_attention.module is PrefixSharingCoreAttention
    assert mla.submodules.self_attention.module is MLASelfAttention  # the input is left alone


@pytest.mark.skipif(stock.HAVE_TE, reason="checks the message shown without Transformer Engine")
def test_te_spec_without_transformer_engine_says_what_is_missing():
    with pytest.raises(ImportError, match=r"needs transformer-engine \(pip install"):
        get_gpt_layer_with_transformer_engine_spec()
