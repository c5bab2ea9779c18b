"""verl's ``router_replay`` with prefix sharing in the real Megatron engine (both releases).

``R3`` (the rollout's routes, ``routed_experts`` in the batch) with sharing on gives what verl's
own R3 gives with sharing off: old log-probs and entropy (``infer_batch``), ``ppo_loss`` and every
gradient (``forward_backward_batch``), on a tiny MoE model, for routes that agree inside shared
prefixes and for routes with one token diverging inside one (where the plan stops sharing; the
step reports ``prefix_sharing/route_divergent_prefix_tokens``). On 0.9.1 verl routes each
sample's last row natively under R3 (its replay mask); sharing keeps those rows native too. The
routes are not the model's own top-k, so the sharing-off run without replay differs: the
comparison shows they were replayed. Also at ``context_parallel_size=2`` (sharing on, router
statistics off) against verl's R3 at CP=1.

``R2`` (routes recorded in ``infer_batch``'s forward, replayed in ``forward_backward_batch``)
with sharing on gives what verl's own R2 gives with sharing off: the recorded routes themselves
(``routed_experts`` in ``infer_batch``'s output, every token's, equal), old log-probs, entropy,
``ppo_loss`` and every gradient, with the update split into three micro-batches where the
recording ran one. Control: the recorded routes shifted by one token replay differently (the
result moves away from the unshifted one) and still equal verl's own replay of the same shifted
routes. ``R2`` under context parallelism is refused by name.
"""

from __future__ import annotations

from functools import partial

import pytest

from tests.verl_ext._requires import require_verl

pytest.importorskip("verl")
import torch  # noqa: E402
from importlib.metadata import version  # noqa: E402

require_verl(version("verl") if version("verl") in ("0.8.0", "0.9.1") else "0.9.1")

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from prefix_sharing.presets import PRESETS  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402

PRESET = PRESETS["tiny-moe"]  # 2 MoE layers, 8 experts, top-2
SHARING = dict(mode="arbitrary_prefix", min_prefix_len=1)
# no per-sequence statistic: verl's patched router drops megatron's padding mask
BATCH = 6  # the GRPO batch: 2 prompts x 3 responses
MOE = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
           moe_z_loss_coeff=0.001, moe_enable_routing_replay=True,
           enable_routing_replay=True)  # verl 0.8.0 reads its own flag (its patched config takes it)


def _config(prefix_grouper: dict | None, mode: str, context_parallel_size: int = 1):
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = dict(
        _target_="verl.workers.config.McoreActorConfig", rollout_n=3, ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
        megatron=dict(_target_="verl.workers.config.McoreEngineConfig", use_mbridge=True,
                      vanilla_mbridge=True, context_parallel_size=context_parallel_size,
                      router_replay=dict(_target_="verl.workers.config.EngineRouterReplayConfig",
                                         mode=mode)),
    )
    if prefix_grouper is not None:
        section.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(section))
    config.engine.use_remove_padding = True
    config.engine.use_dynamic_bsz = False
    config.engine.micro_batch_size_per_gpu = BATCH  # one micro-batch: the routes diverge in it
    return config


def _engine(config):
    """The registered engine with the tiny MoE GPTModel injected (as ``_engine.build_engine``,
    MoE layer specs; the engine's constructor applies verl's router-replay patch first)."""
    from types import SimpleNamespace


    from prefix_sharing.engines.megatron import gpt_model
    from prefix_sharing.megatron_ext import get_gpt_layer_local_spec as shared_spec
    from prefix_sharing.verl_ext.engine import registered_engine

    engine_cls = registered_engine("language_model", "megatron")
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False), model_type="language_model")
    engine = engine_cls(model_config, config.engine, config.optim, config.checkpoint)
    spec = shared_spec(num_experts=PRESET.num_experts, normalization="RMSNorm")
    model = gpt_model(PRESET, layer_spec=spec, **MOE)
    engine.module, engine.tf_config, engine.is_value_model = [model], model.config, False
    return engine


def _batch(workload: str, routes: list | None, micro_batch_size: int = BATCH):
    import torch
    from verl.utils import tensordict_utils as tu

    from tests.verl_ext._batch import make_batch

    data = make_batch(workload, vocab_size=PRESET.vocab_size, micro_batch_size=micro_batch_size)
    if routes is not None:
        data["routed_experts"] = torch.nested.as_nested_tensor(routes, layout=torch.jagged)
    tu.assign_non_tensor(data, enable_routing_replay=True)
    return data


def _r2(workload: str, sharing: dict | None, shift: bool) -> dict:
    """verl's R2 step: ``infer_batch`` records (one micro-batch), ``forward_backward_batch``
    replays the recording (three micro-batches), shifted by one token when ``shift``; on a
    fresh engine with the preset's weights."""
    from verl.workers.utils.losses import ppo_loss

    from tests.verl_ext._batch import plain_output

    config = _config(sharing, "R2")
    engine = _engine(config)
    infer = plain_output(engine.infer_batch(_batch(workload, None)))
    recorded = [r.long() for r in infer["model_output"]["routed_experts"]]
    replayed = [r.roll(1, 0) for r in recorded] if shift else recorded
    train = engine.forward_backward_batch(_batch(workload, replayed, micro_batch_size=2),
                                          partial(ppo_loss, config=config))
    grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
    return {"infer": infer, "train": plain_output(train), "grads": grads, "routes": recorded}


# (routes, run): "shared" is R3 with sharing on, "plain" verl's R3 with it off, "native" no replay
RUNS = {"shared": (SHARING, "R3"), "plain": (None, "R3"), "native": (None, "disabled")}
ONE_RANK = [("agree", "shared"), ("agree", "plain"), ("agree", "native"),
            ("diverge", "shared"), ("diverge", "plain")]


def _job(rank: int, workload: str, runs: list[tuple[str, str]] = ONE_RANK) -> dict:
    """``runs`` at megatron's context-parallel size (``run_distributed(..., cp=)``): the
    gradients then averaged over the CP group as megatron's DDP does (a no-op at CP=1)."""
    from megatron.core import parallel_state
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.config import PrefixSharingConfig
    from prefix_sharing.engines.megatron import finalize_context_parallel_grads
    from prefix_sharing.routes import diverge_inside_shared_prefix, recorded_routes
    from tests.verl_ext._batch import make_batch, plain_output, use_cpu_platform

    use_cpu_platform()
    sequences = list(make_batch(workload, vocab_size=PRESET.vocab_size)["input_ids"].unbind())
    agree = recorded_routes(sequences, PRESET.num_layers, PRESET.moe_router_topk,
                            PRESET.num_experts)
    diverged, _ = diverge_inside_shared_prefix(sequences, agree, PRESET.num_experts,
                                               PrefixSharingConfig(**SHARING))
    cp = parallel_state.get_context_parallel_world_size()
    results = {}
    for routes_name, name in runs:
        routes = {"agree": agree, "diverge": diverged}[routes_name]
        config = _config(*RUNS[name], context_parallel_size=cp)
        engine = _engine(config)
        infer = engine.infer_batch(_batch(workload, routes))
        train = engine.forward_backward_batch(_batch(workload, routes),
                                              partial(ppo_loss, config=config))
        finalize_context_parallel_grads(engine.module[0])
        grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
        results[routes_name, name] = {"infer": plain_output(infer),
                                      "train": plain_output(train), "grads": grads}
    return results


def _one_rank_job(rank: int, workload: str) -> dict:
    """R3 (``ONE_RANK``) and R2, each with sharing on and off."""
    results = _job(rank, workload)
    for shift in (False, True):
        for name, sharing in (("shared", SHARING), ("plain", None)):
            results["R2", shift, name] = _r2(workload, sharing, shift)
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_one_rank_job, 1, "grpo", timeout=600)[0]


@pytest.mark.parametrize("routes", ["agree", "diverge"])
def test_r3_with_sharing_equals_verls_r3_without(results, routes):
    same_outputs(results[routes, "shared"], results[routes, "plain"], f"R3 {routes}")
    native, plain = results["agree", "native"], results["agree", "plain"]
    first = native["infer"]["model_output"]["log_probs"][0]
    assert (first - plain["infer"]["model_output"]["log_probs"][0]).abs().max() > 1e-4


def test_route_divergence_reaches_verls_metrics(results):
    metric = "prefix_sharing/route_divergent_prefix_tokens"
    assert results["agree", "shared"]["train"]["metrics"][metric] == [0.0]
    assert results["diverge", "shared"]["train"]["metrics"][metric][0] > 0
    assert metric not in results["agree", "plain"]["train"]["metrics"]


def test_r2_with_sharing_equals_verls_r2_without(results):
    shared, plain = results["R2", False, "shared"], results["R2", False, "plain"]
    for i, (s, p) in enumerate(zip(shared["routes"], plain["routes"], strict=True)):
        assert s.shape == p.shape and s.size(1) == PRESET.num_layers, f"routes[{i}] shape"
        assert torch.equal(s, p), f"R2 recorded routes of sample {i} differ"
    assert len(plain["train"]["loss"]) == 3  # the update re-split the recorded batch
    same_outputs(shared, plain, "R2")
    metric = "prefix_sharing/route_divergent_prefix_tokens"
    assert shared["train"]["metrics"][metric] == [0.0]  # recorded routes agree where shared


def test_r2_replays_what_it_is_given(results):
    """The control: a replayed route shifted by one token changes the step, with and without
    sharing alike."""
    shifted = results["R2", True, "shared"]
    same_outputs(shifted, results["R2", True, "plain"], "R2 shifted")
    unshifted = results["R2", False, "plain"]
    with pytest.raises(AssertionError, match="relative error"):
        same_outputs(shifted, unshifted, "R2 shifted vs unshifted")


NO_STATISTICS = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                     moe_z_loss_coeff=None)


def _context_parallel_job(rank: int) -> dict:
    """Without router statistics: verl's R3 with sharing off at CP=1 (the two ranks as data
    parallel, the same batch), then R3 with sharing on at CP=2; and, with the statistics back,
    the refusal; and R2's refusal at CP=2."""
    from megatron.core import parallel_state

    statistics = dict(MOE)
    MOE.update(NO_STATISTICS)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    results = _job(rank, "grpo", [("agree", "plain"), ("diverge", "plain")])
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    results.update(_job(rank, "grpo", [("agree", "shared"), ("diverge", "shared")]))
    MOE.update(statistics)
    errors = {}
    try:
        _job(rank, "grpo", [("agree", "shared")])
    except ValueError as e:
        errors["statistics"] = str(e)
    try:
        _engine(_config(SHARING, "R2", context_parallel_size=2))
    except ValueError as e:
        errors["R2"] = str(e)
    results["errors"] = errors
    return results


def test_routing_replay_at_cp2_with_sharing_equals_verls_at_cp1_without():
    """``context_parallel_size=2``: each rank replays the routes of its half of the flat rows,
    routes agreeing and diverging. With router statistics the router would hand verl's
    patched routing (which drops megatron's padding mask) a padded slice of the plain batch:
    refused by name; so is R2's recording under CP."""
    for rank, result in enumerate(run_distributed(_context_parallel_job, 2, cp=2, timeout=600)):
        for routes in ("agree", "diverge"):
            same_outputs(result[routes, "shared"], result[routes, "plain"],
                         f"CP rank {rank} R3 {routes}")
        assert "verl's replay patch drops megatron's padding mask" in result["errors"][
            "statistics"]
        assert "router_replay.mode='R2' with context_parallel_size=2" in result["errors"]["R2"]
