"""HybridModel (megatron-core >= 0.18) with the sharing layers computes what the stock one does.

Spec level: :func:`hybrid.with_prefix_sharing` puts the sharing self-attention, core attention,
MoE layer and router into megatron's own stack specs (the TE ``hybrid_stack_spec`` and the local
one), keeps everything else, refuses spec forms it does not recognise, and makes every slot it
cannot serve (Mamba, GDN, DSA, MLA, multi-token prediction) raise, naming its pattern symbol,
when a pattern builds it.

Model level (one spawned rank, fp32, within 1e-5 relative): an attention + MLP pattern
(``"*-*-"``) and an attention + MLP + MoE pattern (``"*-*E"``) run GRPO, step-wise, tree (with a
duplicate and a strict prefix), agent and unshared micro-batches through megatron's schedule,
shared against megatron's modules on the padded batch (the local hybrid stack spec, with its
``padding_mask``) and, dense, against the same model on megatron's plain THD layout: logits,
log-probs, entropy, loss, every gradient, and for MoE the router's statistics (the logged aux,
seq-aux, global-aux and z-losses, the global aux loss's token counts). A control with the stock
router in the sharing model shows the comparison sees what the sharing router fixes. Both
patterns also run at TP=2 (with sequence parallelism) and PP=2 (two spawned ranks each).

On megatron-core 0.16.1 / 0.17.1 (no ``models/hybrid``) the tests skip, saying so, and one test
checks that the package still imports and the hybrid module says what it needs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re

import pytest

from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff

from ._distributed import run_distributed
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches, runs_by_layout

HAVE_HYBRID = importlib.util.find_spec("megatron.core.models.hybrid") is not None
needs_hybrid = pytest.mark.skipif(
    not HAVE_HYBRID,
    reason="megatron-core has no HybridModel (megatron.core.models.hybrid) before 0.18; "
           "run these tests with megatron-core 0.18.2 or 0.19.2 (Python 3.12)")

DENSE, MOE = "*-*-", "*-*E"  # attention, MLP, attention, MLP / MoE
MOE_VARIANTS = {
    "preset": {},  # softmax scores, aux + seq aux + global aux losses, z-loss
    # HybridStack's own checkpointed forward replays each layer with its plan
    "recompute_full": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
}
REFUSED = {"M": "Mamba", "G": "Gated DeltaNet", "D": "DeepSeek sparse attention",
           "+": "multi-latent attention", "/": "multi-token prediction"}


def _release_symbols() -> set[str]:
    """The refused symbols this megatron-core's stack has a slot for (MLA's '+' came in 0.19)."""
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules

    from prefix_sharing.megatron_ext.hybrid import SLOT_SYMBOLS

    slots = {field.name for field in dataclasses.fields(HybridStackSubmodules)}
    symbols = {SLOT_SYMBOLS[s] for s in slots if SLOT_SYMBOLS.get(s) in REFUSED} | {"/"}
    from prefix_sharing.megatron_ext.stock_gdn import serves_gated_delta_net

    if serves_gated_delta_net():
        symbols.discard("G")  # 0.19.2: shared (tests/megatron_ext/test_gated_delta_net.py)
    return symbols


@pytest.mark.skipif(HAVE_HYBRID, reason="checks the releases without HybridModel")
def test_without_hybrid_model_the_package_imports_and_the_hybrid_module_says_what_it_needs():
    import prefix_sharing.megatron_ext  # noqa: F401  (does not import the hybrid module)

    with pytest.raises(ImportError, match=r"megatron-core >= 0\.18"):
        importlib.import_module("prefix_sharing.megatron_ext.hybrid")


# ----------------------------------------------------------------------------- specs
def _stock_specs():
    from megatron.core.models.hybrid import hybrid_layer_specs

    from prefix_sharing.megatron_ext import hybrid

    return {"te": hybrid_layer_specs.hybrid_stack_spec,
            "local": hybrid.get_hybrid_stack_local_spec(normalization="RMSNorm")}


@needs_hybrid
@pytest.mark.parametrize("flavour", ["te", "local"])
def test_every_attention_and_moe_layer_gets_the_sharing_modules(flavour):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from prefix_sharing.megatron_ext import (
        PrefixSharingCoreAttention,
        PrefixSharingRouter,
        PrefixSharingSelfAttention,
        hybrid,
    )

    stock = _stock_specs()[flavour]
    before = repr(stock)
    shared = hybrid.with_prefix_sharing(stock)
    assert repr(stock) == before  # the stock spec is left as it was

    attention, stock_attention = shared.submodules.attention_layer, stock.submodules.attention_layer
    assert attention.module is stock_attention.module
    assert attention.submodules.self_attention.module is PrefixSharingSelfAttention
    core = attention.submodules.self_attention.submodules.core_attention
    assert core.module is PrefixSharingCoreAttention
    # everything else in the attention layer is the stock spec's
    kept = dataclasses.replace(attention.submodules.self_attention.submodules,
                               core_attention=stock_attention.submodules.self_attention.submodules
                               .core_attention)
    assert kept == stock_attention.submodules.self_attention.submodules

    moe, stock_moe = shared.submodules.moe_layer, stock.submodules.moe_layer
    assert moe.module is hybrid.PrefixSharingMoETransformerLayer
    assert isinstance(moe.submodules.mlp, functools.partial) and moe.submodules.mlp.func is MoELayer
    experts = moe.submodules.mlp.keywords["submodules"]
    assert experts.router is PrefixSharingRouter
    assert dataclasses.replace(experts, router=stock_moe.submodules.mlp.keywords["submodules"]
                               .router) == stock_moe.submodules.mlp.keywords["submodules"]
    assert moe.submodules.pre_mlp_layernorm is stock_moe.submodules.pre_mlp_layernorm

    assert shared.submodules.mlp_layer == stock.submodules.mlp_layer  # per token: unchanged
    assert shared.module is stock.module


@needs_hybrid
def test_an_moe_mlp_given_as_a_module_spec_gets_the_sharing_router_too():
    """megatron-core builds the MoE mlp as a partial from 0.18; a ModuleSpec (the older form,
    or a hand-written stack) is converted alike."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from prefix_sharing.megatron_ext import PrefixSharingRouter, hybrid

    stack = hybrid.get_hybrid_stack_local_spec()
    partial = stack.submodules.moe_layer.submodules.mlp
    stack.submodules.moe_layer.submodules.mlp = ModuleSpec(
        module=MoELayer, submodules=partial.keywords["submodules"], metainfo={"kept": True})
    mlp = hybrid.with_prefix_sharing(stack).submodules.moe_layer.submodules.mlp
    assert mlp.module is MoELayer and mlp.metainfo == {"kept": True}
    assert mlp.submodules == dataclasses.replace(partial.keywords["submodules"],
                                                 router=PrefixSharingRouter)


@needs_hybrid
def test_slots_sharing_cannot_serve_yet_refuse_when_built_naming_their_symbol():
    from megatron.core.transformer.spec_utils import build_module

    from prefix_sharing.megatron_ext import UnsupportedSetupError, hybrid

    shared = hybrid.with_prefix_sharing(_stock_specs()["te"])
    for slot, symbol in hybrid.SLOT_SYMBOLS.items():
        if symbol not in _release_symbols():
            continue
        with pytest.raises(UnsupportedSetupError,
                           match=rf"\(hybrid layer '{re.escape(symbol)}': "
                                 rf"{REFUSED[symbol]}"):
            build_module(getattr(shared.submodules, slot), config=None, layer_number=1)
    for layer in shared.submodules.mtp_block_spec.submodules.layer_specs:
        with pytest.raises(UnsupportedSetupError, match=r"\(hybrid layer '/': multi-token"):
            build_module(layer, config=None, layer_number=1)


@needs_hybrid
def test_spec_forms_it_does_not_recognise_are_refused_naming_the_slot():
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.hybrid import hybrid_layer_specs

    from prefix_sharing.megatron_ext import hybrid

    with pytest.raises(ValueError, match="needs a ModuleSpec of a HybridStack"):
        hybrid.with_prefix_sharing(gpt_layer_specs.get_gpt_layer_local_spec())
    # the inference stack routes with InferenceTopKRouter, which keeps no statistics hook
    with pytest.raises(ValueError, match=r"hybrid layer 'E''s MoE router is "
                                         r"InferenceTopKRouter\): only megatron's TopKRouter"):

        hybrid.with_prefix_sharing(hybrid_layer_specs.hybrid_inference_stack_spec)
    mla_in_attention = hybrid.get_hybrid_stack_local_spec()
    mla_in_attention.submodules.attention_layer = \
        hybrid_layer_specs.hybrid_stack_spec.submodules.dsa_layer  # an MLA self-attention
    with pytest.raises(ValueError, match=r"hybrid layer '\*' has self_attention="
                                         r"ModuleSpec\(\w*MLASelfAttention\)"):
        hybrid.with_prefix_sharing(mla_in_attention)
    moe_in_mlp = hybrid.get_hybrid_stack_local_spec()
    moe_in_mlp.submodules.mlp_layer = moe_in_mlp.submodules.moe_layer
    with pytest.raises(ValueError, match=r"hybrid layer '-' has an MoE mlp"):
        hybrid.with_prefix_sharing(moe_in_mlp)
    dense_in_moe = hybrid.get_hybrid_stack_local_spec()
    dense_in_moe.submodules.moe_layer = dense_in_moe.submodules.mlp_layer  # an MLPLayer
    with pytest.raises(ValueError, match=r"hybrid layer 'E' must be .* got ModuleSpec\(module="
                                         r"MLPLayer\)"):
        hybrid.with_prefix_sharing(dense_in_moe)


# ----------------------------------------------------------------------------- models
def _moe_batches():
    from prefix_sharing.presets import PRESETS
    from prefix_sharing.workloads import make_workload

    sizes = {"grpo": dict(num_prompts=2, group_size=3), "tree": dict(depth=2, branching=2),
             "agent": dict(num_tasks=1, num_turns=2, branching=2, system_len=6, task_len=(2, 4),
                           turn_len=(2, 4)),
             "none": dict(num_sequences=3)}
    return [make_workload(name, vocab_size=PRESETS["tiny-moe"].vocab_size, seed=i, **size)
            .sequences for i, (name, size) in enumerate(sizes.items())]


def _statistics_run(model, batches, layout, config=None):
    """One pass, plus what the routers kept: the logged losses and the global aux loss's
    token counts."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from prefix_sharing.engines.megatron import forward_backward

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    for router in routers:
        router.reset_global_aux_loss_tracker()
    run = forward_backward(model, batches, layout, *([config] if config else []))
    stats = {f"tracker.{name}": entry.values.clone() for name, entry in tracker.metrics.items()}
    for i, router in enumerate(routers):
        stats[f"router{i}.global_tokens_per_expert"] = router.global_tokens_per_expert.clone()
    return run, stats


def _hybrid_job(rank: int) -> dict:
    from prefix_sharing.engines.megatron import compare, forward_backward, hybrid_model
    from prefix_sharing.megatron_ext import UnsupportedSetupError, hybrid, layer_specs
    from prefix_sharing.megatron_ext.checks import hybrid_pattern_problems
    from prefix_sharing.presets import PRESETS

    report = {}
    batches = micro_batches()  # GRPO, step-wise, tree, nothing shared
    ours, stock = hybrid_model(PRESETS["tiny"], DENSE), \
        hybrid_model(PRESETS["tiny"], DENSE, layout="padded")
    shared, _, differences = runs_by_layout(ours, stock, batches)
    report["dense"] = {**differences,
                       "layers": [type(layer).__name__ for layer in ours.decoder.layers],
                       "grads": sorted(shared.grads)}

    preset, batches = PRESETS["tiny-moe"], _moe_batches()
    for name, settings in MOE_VARIANTS.items():
        ours = hybrid_model(preset, MOE, **settings)
        stock = hybrid_model(preset, MOE, layout="padded", **settings)
        shared, shared_stats = _statistics_run(ours, batches, "shared", SHARE_EVERY_PREFIX)
        padded, padded_stats = _statistics_run(stock, batches, "padded")
        report[name] = {
            "shared_vs_padded": compare(shared, padded).max_rel_diff,
            "statistics": {k: max_rel_diff(v, padded_stats[k]) for k, v in shared_stats.items()},
            "statistic_names": sorted(padded_stats),
            "layers": [type(layer).__name__ for layer in ours.decoder.layers],
            "router_grads": [k for k in padded.grads if k.endswith("router.weight")],
        }

    # control: sharing attention, but megatron's stock router counting the flat rows
    attention_only = hybrid.get_hybrid_stack_local_spec(normalization="RMSNorm")
    attention_only.submodules.attention_layer = layer_specs.with_prefix_sharing(
        attention_only.submodules.attention_layer)
    control_model = hybrid_model(preset, MOE, stack_spec=attention_only)
    try:
        forward_backward(control_model, batches, "shared", SHARE_EVERY_PREFIX)
        report["stock_router_refused"] = None
    except UnsupportedSetupError as error:
        report["stock_router_refused"] = str(error)
    # what it would compute, the model check bypassed
    import prefix_sharing.megatron_ext as megatron_ext

    check, megatron_ext.check_sharing_model = megatron_ext.check_sharing_model, lambda model: None
    try:
        control = forward_backward(control_model, batches, "shared", SHARE_EVERY_PREFIX)
    finally:
        megatron_ext.check_sharing_model = check
    report["stock_router_control"] = {k: max_rel_diff(g, padded.grads[k])
                                      for k, g in control.grads.items()
                                      if k.endswith("router.weight")}

    # building a sharing model whose pattern holds a slot sharing cannot serve: a one-layer
    # pattern on the stock (TE) spec, or MTP depths after local layers (the stock MTP block's
    # norms are TE's, so only the sharing model gets as far as its layers on CPU)
    with_mtp = hybrid.get_hybrid_stack_local_spec(normalization="RMSNorm")
    with_mtp.submodules.mtp_block_spec = _stock_specs()["te"].submodules.mtp_block_spec
    refused = {symbol: (symbol, dict(stack_spec=hybrid.with_prefix_sharing(_stock_specs()["te"])))
               for symbol in _release_symbols() - {"/"}}
    refused["/"] = ("*-/*-", dict(stack_spec=hybrid.with_prefix_sharing(with_mtp),
                                  mtp_num_layers=1))
    report["refusals"], report["pattern_refusals"] = {}, {}
    for symbol, (pattern, kwargs) in refused.items():
        # what preflight reads from the pattern alone (checks.hybrid_pattern_problems)
        report["pattern_refusals"][symbol] = [p.key for p in hybrid_pattern_problems(pattern)]
        try:
            hybrid_model(PRESETS["tiny"], pattern, **kwargs)
            report["refusals"][symbol] = None
        except Exception as error:  # noqa: BLE001  (the test reads the type and message)
            report["refusals"][symbol] = (type(error).__name__, str(error))
    return report


@pytest.fixture(scope="module")
def report():
    if not HAVE_HYBRID:
        pytest.skip(needs_hybrid.kwargs["reason"])
    return run_distributed(_hybrid_job, 1, timeout=900)[0]


def _worst(diffs: dict) -> dict:
    return {q: d for q, d in diffs.items() if d > FP32_RTOL}


def test_attention_and_mlp_pattern_is_exact_against_the_padded_and_the_thd_batch(report):
    dense = report["dense"]
    assert dense["layers"] == ["TransformerLayer", "MLPLayer"] * 2
    assert any(".self_attention." in k for k in dense["grads"]) and \
        any(".mlp." in k for k in dense["grads"])
    for pair in ("shared_vs_padded", "shared_vs_packed", "packed_vs_padded"):
        assert not _worst(dense[pair]), (pair, dense[pair])


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_pattern_is_exact_with_the_router_statistics_of_the_plain_batch(report, variant):
    r = report[variant]
    assert r["layers"] == ["TransformerLayer", "MLPLayer", "TransformerLayer",
                           "PrefixSharingMoETransformerLayer"]
    assert r["router_grads"] == ["decoder.layers.3.mlp.router.weight"]
    assert not _worst(r["shared_vs_padded"]), r["shared_vs_padded"]
    # the logged losses of every kind the preset turns on, and the global aux loss's counts
    for name in ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
                 "z_loss"):
        assert f"tracker.{name}" in r["statistic_names"], r["statistic_names"]
    assert "router0.global_tokens_per_expert" in r["statistic_names"]
    assert not _worst(r["statistics"]), r["statistics"]


def test_the_stock_router_in_a_sharing_model_would_change_the_router_gradient(report):
    """What the sharing router is for: megatron's router on the flat rows counts a shared token
    once, so its losses' gradients differ from the plain batch's."""
    assert max(report["stock_router_control"].values()) > 1e-3, report["stock_router_control"]


@needs_hybrid
def test_the_one_with_prefix_sharing_converts_a_hybrid_stack_as_the_hybrid_module_does():
    from prefix_sharing.megatron_ext import hybrid, with_prefix_sharing

    def modules(stack):
        return {f: getattr(getattr(stack.submodules, f), "module", None)
                for f in ("attention_layer", "mlp_layer", "moe_layer")}

    local = hybrid.get_hybrid_stack_local_spec()
    assert modules(with_prefix_sharing(local)) == modules(hybrid.with_prefix_sharing(local))
    assert modules(with_prefix_sharing(local)) != modules(local)


def test_a_sharing_model_with_a_stock_router_is_refused_before_it_runs(report):
    assert "decoder.layers.3.mlp.router (TopKRouter)" in report["stock_router_refused"]


# ----------------------------------------------------------------------------- TP / PP
PARALLEL = {"tp2": (2, 1), "pp2": (1, 2)}  # name: (tensor parallel, pipeline parallel)


def _parallel_job(rank: int) -> dict:
    """Both patterns at TP=2 (with the sequence parallelism megatron's MoE needs there: each
    rank's router statistics are the stock router's on its slice of the padded batch) or PP=2
    (a stage boundary '|' after the second layer)."""
    from megatron.core import parallel_state

    from prefix_sharing.engines.megatron import compare, hybrid_model
    from prefix_sharing.presets import PRESETS

    stages = parallel_state.get_pipeline_model_parallel_world_size() > 1
    sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    report = {}
    for name, pattern, preset, batches in (("dense", DENSE, "tiny", micro_batches()),
                                           ("moe", MOE, "tiny-moe", _moe_batches())):
        pattern = f"{pattern[:2]}|{pattern[2:]}" if stages else pattern
        settings = dict(sequence_parallel=sequence_parallel)
        ours = hybrid_model(PRESETS[preset], pattern, **settings)
        stock = hybrid_model(PRESETS[preset], pattern, layout="padded", **settings)
        shared, shared_stats = _statistics_run(ours, batches, "shared", SHARE_EVERY_PREFIX)
        padded, padded_stats = _statistics_run(stock, batches, "padded")
        report[name] = {
            "shared_vs_padded": compare(shared, padded).max_rel_diff,
            "statistics": {k: max_rel_diff(v, padded_stats[k]) for k, v in shared_stats.items()},
            "layers": [layer.layer_number for layer in ours.decoder.layers],
            "outputs": len(shared.outputs),
        }
    return report


@pytest.fixture(scope="module", params=list(PARALLEL))
def parallel(request):
    if not HAVE_HYBRID:
        pytest.skip(needs_hybrid.kwargs["reason"])
    tp, pp = PARALLEL[request.param]
    return request.param, run_distributed(_parallel_job, tp * pp, tp=tp, pp=pp, timeout=900)


def test_tensor_and_pipeline_parallel_hybrid_models_are_exact(parallel):
    name, ranks = parallel
    for rank, report in enumerate(ranks):
        for pattern, r in report.items():
            assert not _worst(r["shared_vs_padded"]), (name, rank, pattern, r)
            assert not _worst(r["statistics"]), (name, rank, pattern, r)
    moe = [report["moe"] for report in ranks]
    if name == "pp2":  # each stage holds its half of the layers; the last computes the loss
        assert [r["layers"] for r in moe] == [[1, 2], [3, 4]]
        assert [r["outputs"] for r in moe] == [0, len(_moe_batches())]
    # the MoE layer's ranks kept every router statistic
    assert all(len(r["statistics"]) == 5 for r in moe if 4 in r["layers"])


@pytest.mark.parametrize("symbol", list(REFUSED))
def test_a_pattern_with_a_slot_sharing_cannot_serve_raises_naming_the_symbol(report, symbol):
    if symbol not in report["refusals"]:
        pytest.skip(f"this megatron-core does not refuse hybrid layer {symbol!r} (it has no "
                    "such slot, or shares it: 'G' on 0.19.2)")
    kind, message = report["refusals"][symbol]
    assert kind == "UnsupportedSetupError"
    assert f"(hybrid layer {symbol!r}: {REFUSED[symbol]}" in message
    # preflight reads the same refusal from the pattern alone
    assert report["pattern_refusals"][symbol] == ["megatron.hybrid_layer"]

