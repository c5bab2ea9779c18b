"""Drives verl's real Megatron engine (0.9.1 or 0.8.0) in-process on CPU (no Ray), as a verl
worker would.

Per rank (spawned by ``run_distributed``, which sets up megatron on gloo): select a CPU platform
in ``verl.plugin.platform``, build the actor config through verl's own config conversion
(``McoreActorConfig``, with ``prefix_grouper``), instantiate the registered language-model engine
with the tiny preset's GPTModel injected (verl's ``initialize()`` would load HF weights), then
run ``infer_batch`` (old log-probs) and ``train_batch``'s core, ``forward_backward_batch`` with
verl's ``ppo_loss``, on a batch laid out as verl's trainer lays it out (left-padded prompts,
right-padded responses, then ``left_right_2_no_padding``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (registers the engine, patched)

from ._batch import PRESET, make_batch, plain_output, use_cpu_platform


# MoE router losses whose statistics verl's stock step and sharing define alike (docs/moe.md:
# megatron's THD path makes the packed micro-batch one sequence in seq_aux_loss, sharing one per
# sample, and under sequence parallelism takes the z-loss as a sum of means over each rank's
# slice of its packed rows, sharing of the padded batch's; the load-balancing statistics agree)
ROUTER_LOSSES = dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                     moe_aux_loss_coeff=[0.1, 0.1], moe_z_loss_coeff=None)


def actor_config(prefix_grouper: dict | None, *, megatron: dict | None = None, **overrides: Any):
    """verl's ``McoreActorConfig`` built the way the worker builds it (OmegaConf -> dataclass);
    ``megatron``: engine settings (e.g. ``context_parallel_size``)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = dict(
        _target_="verl.workers.config.McoreActorConfig", rollout_n=3, ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
        megatron=dict(_target_="verl.workers.config.McoreEngineConfig", use_mbridge=True,
                      vanilla_mbridge=True, **(megatron or {})), **overrides,
    )
    if prefix_grouper is not None:
        section.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(section))
    config.engine.use_remove_padding = True
    config.engine.use_dynamic_bsz = False
    config.engine.micro_batch_size_per_gpu = 2
    return config


def build_engine(config, *, seed: int = 0, preset=PRESET, spec: dict | None = None,
                 model_type: str = "language_model", mtp: SimpleNamespace | None = None,
                 **model_overrides: Any):
    """The registered megatron engine of ``model_type`` for ``config``, tiny model injected
    (``spec``: the layer spec's arguments, e.g. ``num_experts``; ``model_overrides``: its
    TransformerConfig fields, e.g. ``recompute_granularity``; a value model's head is the
    caller's to put in). ``mtp``: verl's ``model.mtp`` section; with ``enable`` the model has
    ``mtp_num_layers`` MTP layers (a model override) and gets what ``initialize()`` does after
    the build: verl's ``patch_engine_mtp``, then the sharing engine's ``share_verl_mtp``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from prefix_sharing.engines.megatron import model_chunks
    from prefix_sharing.megatron_ext import get_gpt_layer_local_spec as shared_spec
    from prefix_sharing.verl_ext.engine import registered_engine

    engine_cls = registered_engine(model_type, "megatron")
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=mtp or SimpleNamespace(enable=False, enable_train=False), model_type=model_type,
    )
    engine = engine_cls(model_config, config.engine, config.optim, config.checkpoint)
    # The vanilla-mbridge hook, as _build_tf_config leaves it: the bridge builds its layer spec
    # lazily. Megatron's stock local spec cannot run packed sequences on CPU, the project's
    # core attention can: the plain engine runs it without a plan.
    engine.provider = None
    spec_args = spec or {}
    engine.bridge = SimpleNamespace(
        _get_transformer_layer_spec=lambda vp_stage=None: get_gpt_layer_local_spec(**spec_args))
    if getattr(engine, "prefix_sharing", None) is not None and engine.prefix_sharing.enabled:
        from prefix_sharing.verl_ext.mcore_engine import install_layer_spec
        install_layer_spec(engine)
        layer_spec = engine.bridge._get_transformer_layer_spec()
    else:
        layer_spec = shared_spec(**spec_args)
    chunks = model_chunks(preset, seed=seed, layer_spec=layer_spec, **_verl_pipeline_settings(),
                          **model_overrides)
    engine.module, engine.tf_config = chunks, chunks[0].config
    engine.is_value_model = model_type == "value_model"
    if model_config.mtp.enable:  # as initialize() does once the model is built
        from verl.utils.megatron_utils import patch_engine_mtp

        patch_engine_mtp(engine.module, model_config)
        if getattr(engine, "prefix_sharing", None) is not None and engine.prefix_sharing.enabled:
            from prefix_sharing.verl_ext.mcore_mtp import share_verl_mtp

            share_verl_mtp(engine.module, model_config)
    return engine


def _verl_pipeline_settings() -> dict:
    """What verl's engine sets on the TransformerConfig under virtual pipeline stages (its
    provider overrides in ``transformer_impl``), which megatron's schedule needs at PP=2."""
    from megatron.core import parallel_state

    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        return {}
    return dict(overlap_p2p_comm=True, batch_p2p_comm=False)


def step(engine, config, data: Callable[[], Any], during: Any = None,
         finalize: Callable[[Any], None] | None = None) -> dict:
    """On ``engine``: old log-probs + entropy (``infer_batch``), then verl's ``ppo_loss`` and
    every gradient (``forward_backward_batch``, inside the context manager ``during`` when
    given; then ``finalize(model)``, e.g. megatron's sequence-parallel gradient sum), each on a
    fresh ``data()``; picklable, as the tests compare them."""
    from verl.workers.utils.losses import ppo_loss

    infer = engine.infer_batch(data())
    with during or contextlib.nullcontext():
        train = engine.forward_backward_batch(data(), partial(ppo_loss, config=config))
    if finalize is not None:
        for chunk in engine.module:
            finalize(chunk)
    grads = {}
    for c, chunk in enumerate(engine.module):  # a model chunk per virtual stage
        prefix = f"chunk{c}." if len(engine.module) > 1 else ""
        grads.update({prefix + n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for n, p in chunk.named_parameters()})  # zeros: a layer not run
    return {"infer": plain_output(infer), "train": plain_output(train), "grads": grads}


def run(rank: int, workloads: list[str], modes: dict[str, dict | None], *,
        layout: str = "legacy", batches: dict[str, dict] | None = None) -> dict:
    """For each workload and each sharing setting (name -> ``prefix_grouper`` block or ``None``
    for the feature off): old log-probs + entropy (``infer_batch``), then ``ppo_loss`` and every
    gradient (``forward_backward_batch``), each on a fresh copy of the same seeded model.

    The engine's ``context_parallel_size`` is megatron's (``run_distributed(..., cp=)``); the
    gradients are then averaged over the CP group, as megatron's DDP does before the optimizer
    step (a no-op at CP=1). ``layout``: the trainer whose batch layout the engine gets
    (``_batch.make_batch``: ``"legacy"`` or verl 0.9's ``"v1"``); ``batches``: per workload,
    ``make_batch``'s keywords (its sizes, its micro-batch size).

    Under virtual pipeline stages (``run_distributed(..., vpp=)``) the model has a layer per
    model chunk and the engine config names the stages, as verl's worker would build them."""
    from megatron.core import parallel_state
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import finalize_context_parallel_grads

    use_cpu_platform()
    cp = parallel_state.get_context_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    megatron = {"context_parallel_size": cp} if cp > 1 else {}
    preset = PRESET
    if vpp is not None:  # a layer per model chunk
        megatron.update(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp)
        preset = dataclasses.replace(PRESET, num_layers=2 * vpp)
    results = {}
    for workload in workloads:
        for name, prefix_grouper in modes.items():
            config = actor_config(prefix_grouper, megatron=megatron or None)
            engine = build_engine(config, preset=preset)
            sizes = (batches or {}).get(workload, {})
            infer = engine.infer_batch(make_batch(workload, layout=layout, **sizes))
            rows = _count_rows(engine.module[0])
            train = engine.forward_backward_batch(make_batch(workload, layout=layout, **sizes),
                                                  partial(ppo_loss, config=config))
            grads = {}
            for c, chunk in enumerate(engine.module):  # a model chunk per virtual stage
                finalize_context_parallel_grads(chunk)
                prefix = f"chunk{c}." if len(engine.module) > 1 else ""
                grads.update({prefix + n: p.grad.clone() for n, p in chunk.named_parameters()})
            results[workload, name] = {"infer": plain_output(infer), "train": plain_output(train),
                                      "grads": grads, "rows": rows}
    return results


def _count_rows(model) -> list[int]:
    """From now on, the token rows this rank's model receives per micro-batch (the forward's
    ``input_ids`` width: this rank's share of the packed or flat layout)."""
    rows: list[int] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].size(1)), with_kwargs=True)
    return rows
