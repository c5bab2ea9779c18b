"""The model check refuses stock recurrent mixers and stock multi-token prediction while sharing.

The modules are megatron's own classes, made without running their constructors (which need
process groups, and flash-linear-attention or mamba_ssm): the check reads only what they are.
"""

from __future__ import annotations

import pytest
import torch


def _bare(cls: type) -> torch.nn.Module:
    """An instance of megatron module ``cls`` that is only a ``torch.nn.Module``."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    return module


def _model(**modules: torch.nn.Module) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, module in modules.items():
        model.add_module(name, module)
    return model


@pytest.mark.mcore_release_check
@pytest.mark.parametrize("module, name", [("megatron.core.ssm.gated_delta_net", "GatedDeltaNet"),
                                          ("megatron.core.ssm.mamba_mixer", "MambaMixer")])
def test_stock_recurrent_mixers_are_named(module, name):
    from prefix_sharing.megatron_ext.model_check import stock_modules

    # megatron-core 0.16.1's Mamba mixer imports triton, which its Python 3.11 set-up lacks
    mixer = getattr(pytest.importorskip(module, exc_type=ImportError), name)
    assert stock_modules(_model(mixer=_bare(mixer))) == [f"mixer ({name})"]


def test_the_sharing_gated_delta_net_passes():
    from prefix_sharing.megatron_ext.stock_gdn import serves_gated_delta_net

    if not serves_gated_delta_net():
        pytest.skip("the sharing GDN mixer needs megatron-core 0.19.2")
    from prefix_sharing.megatron_ext.gated_delta_net import PrefixSharingGatedDeltaNet
    from prefix_sharing.megatron_ext.model_check import stock_modules

    assert stock_modules(_model(gdn=_bare(PrefixSharingGatedDeltaNet))) == []


@pytest.mark.mcore_release_check
def test_stock_multi_token_prediction_is_refused_naming_what_is_stock():
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlock,
                                                                  MultiTokenPredictionLayer)

    from prefix_sharing.megatron_ext import (PrefixSharingMTPLayer, UnsupportedSetupError,
                                             check_sharing_model, share_multi_token_prediction)

    stock_block = _bare(MultiTokenPredictionBlock)
    stock_block.layers = torch.nn.ModuleList([_bare(MultiTokenPredictionLayer)])
    with pytest.raises(UnsupportedSetupError, match=r"stock MTP layers mtp\.layers\.0"):
        check_sharing_model(_model(mtp=stock_block))

    block = _bare(MultiTokenPredictionBlock)
    block.layers = torch.nn.ModuleList([_bare(PrefixSharingMTPLayer)])
    model = _model(mtp=block)
    model._postprocess = lambda **_: None  # GPTModel's, stock
    with pytest.raises(UnsupportedSetupError, match=r"share_multi_token_prediction\(model\)"):
        check_sharing_model(model)
    check_sharing_model(share_multi_token_prediction(model))  # passes
