"""``--spec prefix_sharing.megatron_ext.megatron_lm_spec layer_spec``: built from Megatron-LM's
parsed arguments when a Megatron-LM run has parsed them (read from ``megatron.training.
global_vars``, which megatron-core 0.17+ ships whether or not Megatron-LM runs), the default
local spec otherwise; builder options forwarded or refused by name."""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import textwrap

import pytest
from megatron.core.models.gpt import gpt_layer_specs as stock

from prefix_sharing.megatron_ext import UnsupportedSetupError, get_gpt_layer_local_spec
from prefix_sharing.megatron_ext.core_attention import PrefixSharingCoreAttention
from prefix_sharing.megatron_ext.megatron_lm_spec import layer_spec_for, megatron_lm_args

LOCAL = dict(transformer_impl="local", num_experts=None, moe_grouped_gemm=False,
             qk_layernorm=True, multi_latent_attention=False, normalization="RMSNorm")


def _spec_module_is_local_spec(args: dict | None, expected: dict) -> str:
    """Imports the --spec module in a fresh interpreter, with Megatron-LM's global args set to
    ``args`` (a parsed run), or with ``megatron.training.global_vars`` imported but nothing
    parsed (``None``); prints whether it equals the local spec built with ``expected``."""
    code = textwrap.dedent(f"""
        import argparse, sys, types
        global_vars = types.ModuleType("megatron.training.global_vars")
        args = {args!r}
        global_vars._GLOBAL_ARGS = None if args is None else argparse.Namespace(**args)
        sys.modules["megatron.training.global_vars"] = global_vars
        from megatron.core.transformer.spec_utils import import_module
        from prefix_sharing.megatron_ext import get_gpt_layer_local_spec
        spec = import_module(("prefix_sharing.megatron_ext.megatron_lm_spec", "layer_spec"))
        print(repr(spec) == repr(get_gpt_layer_local_spec(**{expected!r})))  # 0.19: partials
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_spec_module_without_parsed_megatron_lm_arguments_is_the_default_local_spec():
    assert _spec_module_is_local_spec(None, {}) == "True"


def test_spec_module_follows_parsed_megatron_lm_arguments():
    expected = dict(qk_layernorm=True, normalization="RMSNorm")
    assert _spec_module_is_local_spec(LOCAL, expected) == "True"


def test_megatron_lm_args_reads_global_vars_only_when_a_run_imported_them(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars", raising=False)
    assert megatron_lm_args() is None
    parsed = argparse.Namespace(**LOCAL)
    fake = type(sys)("megatron.training.global_vars")
    fake._GLOBAL_ARGS = parsed
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", fake)
    assert megatron_lm_args() is parsed


def test_no_arguments_give_the_default_local_spec():
    assert repr(layer_spec_for(None)) == repr(get_gpt_layer_local_spec())


@pytest.mark.skipif(
    "qk_l2_norm" not in inspect.signature(stock.get_gpt_layer_local_spec).parameters,
    reason="this megatron-core's local spec builder has no qk_l2_norm",
)
def test_qk_l2_norm_is_honoured():
    args = argparse.Namespace(**{**LOCAL, "qk_layernorm": False, "qk_l2_norm": True})
    spec = layer_spec_for(args)
    attention = spec.submodules.self_attention.submodules
    assert attention.q_layernorm.__name__ == "L2Norm" and attention.k_layernorm.__name__ == "L2Norm"
    assert attention.core_attention.module is PrefixSharingCoreAttention


@pytest.mark.parametrize("setting, value, message", [
    ("experimental_attention_variant", "gated_delta_net", "--experimental-attention-variant"),
    ("heterogeneous_layers_config_path", "/h.json", "--heterogeneous-layers-config-path"),
    ("restore_modelopt_state", True, "--restore-modelopt-state"),
    ("use_kitchen_attention", True, "--use-kitchen-attention"),
    ("attention_backend", "AttnBackend.local", "--attention-backend local"),
    ("transformer_impl", "inference_optimized", "--transformer-impl inference_optimized"),
    # the local builder has no use_te_op_fuser option on any release
    ("use_transformer_engine_op_fuser", True, "--use-transformer-engine-op-fuser"),
])
def test_arguments_the_sharing_spec_cannot_honour_are_refused_by_name(setting, value, message):
    with pytest.raises(UnsupportedSetupError, match=message):
        layer_spec_for(argparse.Namespace(**{**LOCAL, setting: value}))


def test_mtp_layers_build_around_the_sharing_layer():
    """Megatron-LM builds the MTP block spec around this layer spec; the sharing forward step
    makes its layers the sharing ones (``prefix_sharing.megatron_lm``)."""
    spec = layer_spec_for(argparse.Namespace(**{**LOCAL, "mtp_num_layers": 1}))
    assert spec.submodules.self_attention.submodules.core_attention.module is (
        PrefixSharingCoreAttention)


def test_moe_on_some_layers_only_is_refused():
    args = argparse.Namespace(**{**LOCAL, "num_experts": 4, "moe_layer_freq": [1, 0]})
    with pytest.raises(UnsupportedSetupError, match="--moe-layer-freq"):
        layer_spec_for(args)
