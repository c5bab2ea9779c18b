"""Under MindSpeed's patches the prefix-sharing GPTModel still computes the plain results.

MindSpeed is emulated by ``fake_mindspeed`` (written from MindSpeed's source, see its doc): its
import replaces ``DotProductAttention.forward`` with a top-left-causal fused attention, RoPE
with a fused rotary whose THD branch restarts positions per segment, and the class
``TEDotProductAttention``; ``repatch`` removes and re-applies everything. The shared model runs
``backend="npu"`` on the ``torch_npu`` stand-in, as on Ascend. Every case runs in a spawned
rank (patches outlive a test), in both import orders, before and after a repatch, and compares
logits, log-probs, entropy, loss and every gradient with the plain model (fp32: 1e-5).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

import pytest

from prefix_sharing.engines.megatron import compare, forward_backward
from prefix_sharing.equivalence import FP32_RTOL
from prefix_sharing.npu import incompatible_options
from prefix_sharing.npu.mindspeed import CP_ALGORITHMS_REFUSED

from ..attention import fake_kernels
from ..megatron_ext._distributed import run_distributed, tiny_gpt
from ..megatron_ext._equivalence import SHARE_EVERY_PREFIX, micro_batches
from . import fake_mindspeed

WORKLOADS = ["grpo", "tree"]  # shared prompts; a tree with a duplicate and a strict prefix
ON_NPU = dataclasses.replace(SHARE_EVERY_PREFIX, backend="npu")
ORDERS = ("mindspeed_first", "prefix_sharing_first")


def _mindspeed_job(rank: int, order: str) -> dict:
    from prefix_sharing.npu import enable_mindspeed

    monkeypatch = pytest.MonkeyPatch()
    npu = fake_kernels.install_torch_npu(monkeypatch)  # MindSpeed runs on torch_npu
    fake_mindspeed.install(monkeypatch)
    batches = micro_batches(WORKLOADS)
    report: dict = {}
    if order == "prefix_sharing_first":  # the rank's setup has imported megatron_ext already
        report["unpatched_plain"] = forward_backward(tiny_gpt("padded"), batches, "padded")
        adaptor = importlib.import_module("mindspeed.megatron_adaptor")
    else:
        _forget_megatron_ext()  # so its classes are defined on the patched megatron-core
        adaptor = importlib.import_module("mindspeed.megatron_adaptor")
        report["unguarded_stock_fed_a_plan"] = _stock_fed_a_plan(batches)
    enable_mindspeed()
    enable_mindspeed()  # idempotent: one feature, one guard
    report["before_repatch"] = _run(batches, npu)
    adaptor.repatch({"optimization_level": 2})
    report["after_repatch"] = _run(batches, npu)
    report["guarded_stock_fed_a_plan"] = _stock_fed_a_plan(batches)
    report["model_check_on_stock"] = _stock_fed_a_plan(batches, model_check=True)
    report["spec_module"] = _megatron_lm_spec_layers()
    try:
        adaptor.repatch({"reset_attention_mask": True})
    except Exception as err:  # noqa: BLE001 - the type is checked by the test
        report["repatch_with_reset_attention_mask"] = (type(err).__name__, str(err))
    return report


def _forget_megatron_ext() -> None:
    for name in [n for n in sys.modules if n.startswith("prefix_sharing.megatron_ext")]:
        del sys.modules[name]
    sys.modules["prefix_sharing"].__dict__.pop("megatron_ext", None)


def _patches_in_force() -> dict:
    from megatron.core.extensions import transformer_engine
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

    names = [f.feature_name for f in MindSpeedFeaturesManager.FEATURES_LIST]
    return {
        "one_prefix_sharing_feature": names.count("prefix_sharing") == 1,
        # under the prefix-sharing feature's guard, MindSpeed's forward is the wrapped function
        "attention": DotProductAttention.forward.__wrapped__
        is fake_mindspeed.fused_attention_forward,
        "rope": rope_utils.apply_rotary_pos_emb is fake_mindspeed.fused_apply_rotary_pos_emb,
        "te_class": transformer_engine.TEDotProductAttention
        is fake_mindspeed.TEDotProductAttentionStandIn,
    }


def _run(batches, npu) -> dict:
    from prefix_sharing.megatron_ext import PrefixSharingCoreAttention, PrefixSharingSelfAttention

    ours, plain = tiny_gpt("shared"), tiny_gpt("padded")
    attention = ours.decoder.layers[0].self_attention
    fake_mindspeed.CALLS.clear()
    npu.calls.clear()
    npu.backward_calls.clear()
    shared = forward_backward(ours, batches, "shared", ON_NPU)
    calls_shared = dict(fake_mindspeed.CALLS, npu_fusion_attention=len(npu.calls),
                        npu_fusion_attention_grad=len(npu.backward_calls))
    fake_mindspeed.CALLS.clear()
    reference = forward_backward(plain, batches, "padded")
    return {
        "ours_in_place": isinstance(attention, PrefixSharingSelfAttention)
        and isinstance(attention.core_attention, PrefixSharingCoreAttention),
        "patches": _patches_in_force(),
        "calls_shared": calls_shared,
        "calls_plain": dict(fake_mindspeed.CALLS),
        "shared": shared,
        "plain": reference,
    }


def _megatron_lm_spec_layers() -> tuple[str, str]:
    """The classes ``--spec prefix_sharing.npu.megatron_lm_spec layer_spec`` puts in the layer."""
    from prefix_sharing.npu.megatron_lm_spec import layer_spec

    attention = layer_spec.submodules.self_attention
    return attention.module.__name__, attention.submodules.core_attention.module.__name__


def _stock_fed_a_plan(batches, model_check=False):
    """megatron's stock spec given a plan: MindSpeed's kernels compute it (wrongly) unless the
    prefix-sharing feature stops it. Returns the run, or the error raised. Without
    ``model_check`` the engine's own check_sharing_model (which refuses a stock model before it
    runs) is bypassed, as for a user who calls the model directly, so what is tested is the
    guard in MindSpeed's attention."""
    import prefix_sharing.megatron_ext as megatron_ext

    check = megatron_ext.check_sharing_model
    if not model_check:
        megatron_ext.check_sharing_model = lambda model: None
    try:
        return forward_backward(tiny_gpt("padded"), batches, "shared", SHARE_EVERY_PREFIX)
    except Exception as err:  # noqa: BLE001 - the type is checked by the test
        return type(err).__name__, str(err)
    finally:
        megatron_ext.check_sharing_model = check


@pytest.fixture(scope="module")
def reports():
    return {order: run_distributed(_mindspeed_job, 1, order, timeout=600)[0] for order in ORDERS}


@pytest.mark.parametrize("stage", ["before_repatch", "after_repatch"])
@pytest.mark.parametrize("order", ORDERS)
def test_shared_model_equals_plain_model_under_mindspeed(reports, order, stage):
    run = reports[order][stage]
    assert run["ours_in_place"]
    worst = {q: d for q, d in compare(run["shared"], run["plain"]).max_rel_diff.items()
             if d > FP32_RTOL}
    assert not worst, f"{order} {stage}: {worst}"


@pytest.mark.parametrize("stage", ["before_repatch", "after_repatch"])
@pytest.mark.parametrize("order", ORDERS)
def test_mindspeed_patches_were_in_force(reports, order, stage):
    """The emulation bites: the plain model ran MindSpeed's attention and rotary; the shared
    model rotated through MindSpeed's fused rotary (bshd) and attended with
    ``npu_fusion_attention`` over key sources (per layer one call over the own segments,
    sparse_mode 3, and one over the shared nodes, sparse_mode 0: every micro-batch shares;
    each differentiated by ``npu_fusion_attention_grad``), never MindSpeed's attention or THD
    RoPE."""
    run = reports[order][stage]
    assert all(run["patches"].values()), run["patches"]
    layer_calls = len(run["plain"].outputs) * 2  # tiny preset: 2 layers
    assert run["calls_plain"]["attention"] == layer_calls
    assert run["calls_plain"]["rope_bshd"] == 2 * layer_calls  # query and key
    assert run["calls_shared"]["rope_bshd"] == 2 * layer_calls
    assert run["calls_shared"]["npu_fusion_attention"] == 2 * layer_calls  # backend="npu"
    assert run["calls_shared"]["npu_fusion_attention_grad"] == 2 * layer_calls
    assert run["calls_shared"].get("attention", 0) == 0
    assert run["calls_shared"].get("rope_thd", 0) == 0


def test_the_stand_ins_compute_what_megatron_computes(reports):
    """The plain model gives the same results with and without the emulated patches."""
    report = reports["prefix_sharing_first"]
    diffs = compare(report["before_repatch"]["plain"], report["unpatched_plain"]).max_rel_diff
    assert all(d <= FP32_RTOL for d in diffs.values()), diffs


def test_without_the_feature_mindspeeds_attention_gets_a_plan_wrong(reports):
    report = reports["mindspeed_first"]
    wrong = compare(report["unguarded_stock_fed_a_plan"], report["before_repatch"]["plain"])
    assert wrong.max_rel_diff["logits"] > 1e-2


@pytest.mark.parametrize("order", ORDERS)
def test_the_feature_refuses_a_plan_reaching_mindspeeds_attention(reports, order):
    kind, message = reports[order]["guarded_stock_fed_a_plan"]
    assert kind == "UnsupportedSetupError"
    assert "prefix-sharing layer spec" in message


def test_the_engine_refuses_a_stock_model_before_mindspeed_sees_a_plan(reports):
    kind, message = reports["mindspeed_first"]["model_check_on_stock"]
    assert kind == "UnsupportedSetupError"
    assert "stock modules on a sharing forward" in message and "self_attention" in message



@pytest.mark.parametrize("order", ORDERS)
def test_the_ascend_megatron_lm_spec_is_the_prefix_sharing_spec(reports, order):
    assert reports[order]["spec_module"] == ("PrefixSharingSelfAttention",
                                             "PrefixSharingCoreAttention")


def test_enabling_twice_registers_one_feature(reports):
    patches = reports["mindspeed_first"]["before_repatch"]["patches"]
    assert patches["one_prefix_sharing_feature"]
    # a second guard would wrap the first: __wrapped__ would not be MindSpeed's forward
    assert patches["attention"]


@pytest.mark.parametrize("order", ORDERS)
def test_repatch_with_reset_attention_mask_is_refused(reports, order):
    kind, message = reports[order]["repatch_with_reset_attention_mask"]
    assert kind == "UnsupportedSetupError"
    assert "--reset-attention-mask" in message and "dropping the plan" in message


def test_incompatible_options_name_each_option():
    args = argparse.Namespace(reset_attention_mask=True, tp_2d=True,
                              position_embedding_type="alibi", context_parallel_size=2,
                              context_parallel_algo="ulysses_cp_algo")
    problems = incompatible_options(args)
    for option in ("--reset-attention-mask", "--tp-2d", "alibi", "--context-parallel-size 2"):
        assert sum(option in p for p in problems) == 1, (option, problems)
    assert incompatible_options(argparse.Namespace(context_parallel_size=1)) == []


@pytest.mark.parametrize("algorithm", [*CP_ALGORITHMS_REFUSED, "some_future_cp_algo"])
def test_each_mindspeed_cp_algorithm_that_bypasses_the_plan_is_refused_by_name(algorithm):
    args = argparse.Namespace(context_parallel_size=2, context_parallel_algo=algorithm)
    [problem] = incompatible_options(args)
    assert f"--context-parallel-algo {algorithm}" in problem
    assert "use --context-parallel-algo megatron_cp_algo" in problem


@pytest.mark.parametrize("algorithm", [None, "megatron_cp_algo"])  # None: MindSpeed's default
def test_context_parallel_with_megatron_cp_algo_is_accepted(algorithm):
    args = argparse.Namespace(context_parallel_size=2, context_parallel_algo=algorithm)
    assert incompatible_options(args) == []


# ----------------------------------------------------------------- context parallel
def _context_parallel_job(rank: int) -> dict:
    """CP=2 under MindSpeed's context-parallel patch (``megatron_cp_algo``, applied by verl's
    kind of repatch), the shared model on the npu stand-in; then the refusals."""
    from megatron.core.transformer import dot_product_attention

    from prefix_sharing.npu import enable_mindspeed

    monkeypatch = pytest.MonkeyPatch()
    npu = fake_kernels.install_torch_npu(monkeypatch)
    fake_mindspeed.install(monkeypatch)
    adaptor = importlib.import_module("mindspeed.megatron_adaptor")
    enable_mindspeed()
    adaptor.repatch({"context_parallel_size": 2})
    report = {"cp_class_in_place": dot_product_attention.DotProductAttention
              is fake_mindspeed.cp_attention_class()}
    stock = tiny_gpt("padded")  # a stock layer spec now builds MindSpeed's CP attention
    report["stock_core_attention"] = type(stock.decoder.layers[0].self_attention.core_attention).__name__
    fake_mindspeed.CALLS.clear()
    npu.calls.clear()
    npu.backward_calls.clear()
    report["shared"] = forward_backward(tiny_gpt("shared"), micro_batches(WORKLOADS), "shared",
                                        ON_NPU)
    report["calls"] = dict(fake_mindspeed.CALLS, npu_fusion_attention=len(npu.calls),
                           npu_fusion_attention_grad=len(npu.backward_calls))
    report["refused"] = {}
    for algorithm in CP_ALGORITHMS_REFUSED:
        try:
            adaptor.repatch({"context_parallel_algo": algorithm})
        except Exception as err:  # noqa: BLE001 - the type is checked by the test
            report["refused"][algorithm] = (type(err).__name__, str(err))
    # the prefix-sharing layers defined after MindSpeed's CP class took megatron's place
    adaptor.repatch({"context_parallel_algo": "megatron_cp_algo"})
    _forget_megatron_ext()
    importlib.import_module("prefix_sharing.megatron_ext")
    try:
        enable_mindspeed()
    except Exception as err:  # noqa: BLE001 - the type is checked by the test
        report["defined_on_mindspeeds_class"] = (type(err).__name__, str(err))
    return report


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_context_parallel_job, 2, cp=2, timeout=600)


def test_cp2_shared_model_under_mindspeeds_cp_patch_equals_the_plain_model(cp2, reports):
    plain = reports["prefix_sharing_first"]["before_repatch"]["plain"]  # CP=1, same weights
    for rank, report in enumerate(cp2):
        worst = {q: d for q, d in compare(report["shared"], plain).max_rel_diff.items()
                 if d > FP32_RTOL}
        assert not worst, f"CP rank {rank}: {worst}"


def test_mindspeeds_cp_patch_was_in_force_and_never_reached(cp2):
    """MindSpeed's CP class replaced megatron's (a stock spec builds it), yet the shared model
    ran its own attention on the npu kernel: never MindSpeed's CP attention or RoPE slicing."""
    layer_calls = len(WORKLOADS) * 2  # micro-batches x the tiny preset's 2 layers
    for report in cp2:
        assert report["cp_class_in_place"]
        assert report["stock_core_attention"] == "MindSpeedCPDotProductAttention"
        # per layer, one call for the rank's own query pieces and, where its rows read shared
        # nodes, one over them (attention over sources); each differentiated once
        calls = report["calls"]
        assert layer_calls <= calls["npu_fusion_attention"] <= 2 * layer_calls
        assert calls["npu_fusion_attention_grad"] == calls["npu_fusion_attention"]
        assert not report["calls"].get("cp_attention") and not report["calls"].get("cp_rotary_slice")


def test_a_repatch_with_a_cp_algorithm_that_bypasses_the_plan_is_refused(cp2):
    refused = cp2[0]["refused"]
    assert set(refused) == set(CP_ALGORITHMS_REFUSED)
    for algorithm, (kind, message) in refused.items():
        assert kind == "UnsupportedSetupError"
        assert f"--context-parallel-algo {algorithm}" in message


def test_sharing_layers_defined_on_mindspeeds_cp_class_are_refused(cp2):
    kind, message = cp2[0]["defined_on_mindspeeds_class"]
    assert kind == "UnsupportedSetupError"
    assert "defined on MindSpeed's MindSpeedCPDotProductAttention" in message


def test_enable_without_mindspeed_names_what_is_missing(monkeypatch):
    from prefix_sharing.npu import enable_mindspeed

    monkeypatch.setitem(sys.modules, "mindspeed", None)
    with pytest.raises(ImportError, match="MindSpeed.*core_r0.16.0"):
        enable_mindspeed()
