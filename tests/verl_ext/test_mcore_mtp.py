"""verl's MTP training (``model.mtp.enable_train``) in the Megatron engine with
``prefix_grouper`` on equals verl's stock step (verl's patched ``_postprocess``: labels and the
prompt-zeros + response loss mask rolled along each sample, the output layer detached from the
MTP loss on megatron-core 0.16): old log-probs, entropy, ``ppo_loss``, the logged MTP losses
and every gradient (the MTP layers', the embedding's, the output layer's), fp32 within 1e-5;
GRPO, tree and step-wise batches; one and two depths; ``mtp.detach_encoder``; MoE (the
tiny-moe preset, its MTP layer MoE as well, with the router losses verl's packed step and
sharing define alike);
``use_fused_kernels`` (which verl turns off when MTP is enabled: neither side calls the CPU
stand-in of its kernel); TP=2 with
sequence parallelism, PP=2 (the MTP layers on the last stage), PP=2 x VPP=2 (in the last
model chunk) and CP=2 (against the stock step on one rank). Fixed micro-batches keep verl's sample order: the MTP loss is averaged per
micro-batch. The MTP loss is not vacuous (it moves the decoder's gradients), and the
layers are not run where verl does not train them (``enable_train: false``)."""

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

import dataclasses  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import MODES, close, same_outputs  # noqa: E402

BOTH = ("off", "arbitrary_prefix")
VPP_BATCHES = {"grpo": dict(num_prompts=2, group_size=2), "steprl": dict(num_chains=1, num_steps=4)}
class Case(NamedTuple):
    workloads: tuple[str, ...]
    depths: int = 1  # mtp_num_layers
    detach_encoder: bool = False
    enable_train: bool = True
    fused: bool = False  # use_fused_kernels
    moe: bool = False  # the tiny-moe preset, MTP layers MoE too


CASES = {
    "depth1": Case(("grpo", "tree", "steprl")),
    "depth2-detach": Case(("grpo", "tree"), depths=2, detach_encoder=True),
    "not-trained": Case(("grpo",), enable_train=False),
    # verl turns use_fused_kernels off when MTP is enabled (_maybe_enable_fused_kernels): the
    # MTP layers train, and neither side calls the fused kernel
    "fused": Case(("grpo",), fused=True),
    # router losses whose statistics verl's packed step and sharing define alike (docs/moe.md)
    "moe": Case(("grpo", "tree"), moe=True),
}


def _mtp_section(detach_encoder: bool, enable_train: bool) -> SimpleNamespace:
    return SimpleNamespace(enable=True, enable_train=enable_train,
                           detach_encoder=detach_encoder, mtp_loss_scaling_factor=0.1)


def _job(rank: int, cases: tuple[str, ...], modes: tuple[str, ...], parallel: dict) -> dict:
    """Each case, workload and mode on a fresh engine of the ``parallel`` sizes (verl's engine
    settings: ``tensor_model_parallel_size`` with sequence parallelism,
    ``context_parallel_size``, ``pipeline_model_parallel_size``), as ``run_distributed`` laid
    the ranks out; gradients summed as megatron's DDP does before the optimizer step."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from prefix_sharing.engines.megatron import (finalize_context_parallel_grads,
                                                 finalize_sequence_parallel_grads)
    from prefix_sharing.presets import PRESETS
    from tests.verl_ext import fake_linear_cross_entropy
    from tests.verl_ext._batch import PRESET, make_batch, use_cpu_platform
    from tests.verl_ext._engine import ROUTER_LOSSES, actor_config, build_engine, step

    def finalize(model) -> None:
        finalize_sequence_parallel_grads(model)
        finalize_context_parallel_grads(model)

    use_cpu_platform()
    tp = parallel.get("tensor_model_parallel_size", 1) > 1
    megatron = dict(parallel, sequence_parallel=True) if tp else parallel
    overrides = {"sequence_parallel": True} if tp else {}
    sizes = {}
    if parallel.get("virtual_pipeline_model_parallel_size"):  # a layer per model chunk, and
        overrides["preset"] = dataclasses.replace(PRESET, num_layers=4)  # micro-batches in
        sizes = VPP_BATCHES  # a multiple of the stages, as verl's schedule requires
    found = {}
    for name in cases:
        case = CASES[name]
        MTPLossLoggingHelper.tracker.clear()  # sized by the first model's depths
        model = dict(overrides)
        if case.moe:
            moe = PRESETS["tiny-moe"]
            model.update(preset=moe, spec=dict(num_experts=moe.num_experts),
                         **ROUTER_LOSSES)
        for workload in case.workloads if not sizes else sizes:
            for mode in modes:
                config = actor_config(MODES[mode], megatron=megatron or None)
                config.engine.use_fused_kernels = case.fused
                with fake_linear_cross_entropy.installed() as calls:
                    engine = build_engine(config, mtp=_mtp_section(case.detach_encoder,
                                                                   case.enable_train),
                                          mtp_num_layers=case.depths, **model)
                    if case.fused:
                        engine._maybe_enable_fused_kernels()  # as verl's initialize() does
                    found[name, workload, mode] = step(
                        engine, config, lambda: make_batch(workload, **sizes.get(workload, {})),
                        finalize=finalize)
                found[name, workload, mode]["kernel_calls"] = len(calls)
        if name == "depth1" and not parallel:  # no MTP loss: the decoder's gradients move
            config = actor_config(MODES["arbitrary_prefix"])
            engine = build_engine(config, mtp=_mtp_section(False, True), mtp_num_layers=1,
                                  mtp_loss_scaling_factor=0.0)
            found[name, "grpo", "unscaled"] = step(engine, config, lambda: make_batch("grpo"))
    return found


@pytest.fixture(scope="module")
def results():
    return run_distributed(_job, 1, tuple(CASES), BOTH, {}, timeout=600)[0]


@pytest.mark.parametrize("case", CASES)
def test_sharing_with_mtp_training_matches_verls_stock_step(results, case):
    for workload in CASES[case].workloads:
        shared, plain = (results[case, workload, mode] for mode in ("arbitrary_prefix", "off"))
        where = f"{case} {workload}"
        same_outputs(shared, plain, where)
        metrics = shared["train"]["metrics"]
        assert metrics["prefix_sharing/tokens_computed"] < metrics["prefix_sharing/tokens_total"]
        assert any("mtp.layers" in name for name in plain["grads"]), f"{where}: no MTP parameters"
        mtp_metrics = {k: v for k, v in plain["train"]["metrics"].items()
                       if k.startswith("mtp_losses/")}
        trained = CASES[case].enable_train
        assert bool(mtp_metrics) == trained, f"{where}: verl logged {mtp_metrics}"
        assert plain["kernel_calls"] == shared["kernel_calls"] == 0
        for key, values in mtp_metrics.items():  # verl's lists, one value per step
            for s, p in zip(shared["train"]["metrics"][key], values, strict=True):
                assert abs(s - p) <= 1e-5 * abs(p), f"{where} {key}: {s} vs {p}"


def test_the_mtp_loss_reaches_the_decoder(results):
    trained, unscaled = results["depth1", "grpo", "arbitrary_prefix"], results[
        "depth1", "grpo", "unscaled"]
    name = next(n for n in trained["grads"] if "decoder.layers.0.mlp" in n)
    with pytest.raises(AssertionError):
        close(trained["grads"][name], unscaled["grads"][name], name)


def test_an_untrained_mtp_layer_gets_no_gradient(results):
    grads = results["not-trained", "grpo", "arbitrary_prefix"]["grads"]
    mtp = [g for n, g in grads.items() if "mtp.layers" in n]
    assert mtp and all(not g.abs().sum() for g in mtp)


@pytest.mark.parametrize("layout", ["tp2_sequence_parallel", "pp2"])
def test_over_two_ranks(layout):
    """TP=2 with sequence parallelism; PP=2, the MTP layers on the last stage, which embeds
    each depth's tokens itself."""
    parallel, ranks = {"tp2_sequence_parallel": ({"tensor_model_parallel_size": 2}, dict(tp=2)),
                       "pp2": ({"pipeline_model_parallel_size": 2}, dict(pp=2))}[layout]
    found = run_distributed(_job, 2, ("depth1",), BOTH, parallel, **ranks, timeout=600)
    for rank, runs in enumerate(found):
        for workload in CASES["depth1"].workloads:
            same_outputs(runs["depth1", workload, "arbitrary_prefix"],
                         runs["depth1", workload, "off"], f"{layout} rank {rank} {workload}")


def test_over_interleaved_pipeline_stages():
    """PP=2 x VPP=2 (a layer per model chunk): the MTP layers sit in the last chunk of the
    last stage."""
    found = run_distributed(_job, 2, ("depth1",), BOTH, {"pipeline_model_parallel_size": 2,
                                                         "virtual_pipeline_model_parallel_size": 2},
                            pp=2, vpp=2, timeout=600)
    for rank, runs in enumerate(found):
        for workload in VPP_BATCHES:
            shared = runs["depth1", workload, "arbitrary_prefix"]
            assert any(name.startswith("chunk1.") for name in shared["grads"])
            if rank == 1:  # the last stage's last chunk holds the MTP layer
                assert any(name.startswith("chunk1.mtp.layers") for name in shared["grads"])
            same_outputs(shared, runs["depth1", workload, "off"],
                         f"PP=2 x VPP=2 rank {rank} {workload}")


def test_context_parallel_sharing_equals_the_stock_step_on_one_rank(results):
    """verl's stock step cannot run CP on CPU (megatron's THD CP attention is CUDA's): CP=2
    with sharing is held to the stock step at CP=1, the MTP loss included."""
    found = run_distributed(_job, 2, ("depth1",), ("arbitrary_prefix",),
                            {"context_parallel_size": 2}, cp=2, timeout=600)
    for rank, runs in enumerate(found):
        for workload in CASES["depth1"].workloads:
            shared, plain = runs["depth1", workload, "arbitrary_prefix"], results[
                "depth1", workload, "off"]
            same_outputs(shared, plain, f"CP=2 rank {rank} {workload}")
            key = "mtp_losses/mtp_1_loss"
            if key in shared["train"].get("metrics", {}):
                assert shared["train"]["metrics"][key] == pytest.approx(
                    plain["train"]["metrics"][key], rel=1e-5)


def test_mtp_training_across_micro_batches_per_token_and_on_fsdp_is_refused_by_name():
    """A group run across micro-batches plans the decoder's rows only; verl normalises a
    per-token MTP loss its own way; the FSDP engines train no MTP layers."""
    from prefix_sharing.config import PrefixSharingConfig
    from prefix_sharing.verl_ext.mcore import check_engine_setup
    from prefix_sharing.verl_ext.mcore_mtp import mtp_problems

    model_config = SimpleNamespace(mtp=_mtp_section(False, True))
    engine = SimpleNamespace(override_transformer_config={})
    (found,) = mtp_problems(model_config, engine, PrefixSharingConfig(cross_micro_batch=True))
    assert found.key == "verl.mtp" and "cross_micro_batch" in found.detail
    assert mtp_problems(model_config, engine, PrefixSharingConfig()) == []
    assert mtp_problems(SimpleNamespace(mtp=_mtp_section(False, False)), engine,
                        PrefixSharingConfig(cross_micro_batch=True)) == []
    per_token = SimpleNamespace(override_transformer_config={"calculate_per_token_loss": True})
    (found,) = mtp_problems(model_config, per_token, PrefixSharingConfig())
    assert found.key == "verl.mtp" and "calculate_per_token_loss" in found.detail
    engine = SimpleNamespace(dynamic_context_parallel=False)
    check_engine_setup(engine, model_config, serves_mtp=True)
    with pytest.raises(Exception, match=r"\[verl\.mtp\]"):
        check_engine_setup(engine, model_config)
