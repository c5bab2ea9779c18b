"""Drives verl's real FSDP engine in-process on CPU (no Ray), as a verl worker would.

Per rank (spawned by ``tests.fsdp_compat._launch.run_gloo``: a plain gloo process group, no
megatron): select a CPU platform, build the actor config through verl's own config conversion
(``FSDPActorConfig``, strategy ``fsdp2`` or ``fsdp`` (FSDP1, verl's default), with
``prefix_grouper``) and the model config through verl's ``HFModelConfig`` on a tiny seeded Qwen2
saved with ``save_pretrained``; instantiate the language-model engine verl's registry selects
and let verl's own ``initialize()`` load the checkpoint, apply its monkey patches and gradient
checkpointing, shard with FSDP2 or FSDP1 and build the optimizer. Then
``infer_batch`` (old log-probs + entropy) and ``train_batch``'s core,
``forward_backward_batch`` with verl's ``ppo_loss``, on batches laid out as verl's trainer lays
them out. fp32 end to end (mixed precision set to fp32, so verl skips autocast), or float64
(:func:`verl_float64`); transformers' ``sdpa`` attention for the plain engine (flash-attention
does not run on CPU), which tells the packed samples apart by their restarting
``position_ids`` (a Gated DeltaNet hybrid's GDN layers do not: its plain runs use verl's padded
layout, ``run(..., padded_off=True)``). FSDP1 on CPU needs one test-only change:
:func:`cpu_fsdp1`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

from ._batch import PRESET, make_batch, plain_output, use_cpu_platform

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
FP64 = {"param_dtype": "fp64", "reduce_dtype": "fp64", "buffer_dtype": "fp64"}


def save_model(directory: str, family: str = "qwen2", seed: int = 0, preset=PRESET,
               **overrides: Any) -> str:
    """A seeded ``family`` model of ``preset``'s shape (the tiny one by default; ``overrides``:
    config fields), saved where verl will load it."""
    from prefix_sharing.fsdp_compat import build_model

    build_model(family, preset, seed=seed, **overrides).save_pretrained(directory)
    return directory


def actor_config(prefix_grouper: dict | None, *, remove_padding: bool = True,
                 strategy: str = "fsdp2", section: dict | None = None, **engine: Any):
    """verl's ``FSDPActorConfig`` built the way the worker builds it (OmegaConf -> dataclass);
    ``engine`` overrides ``fsdp_config`` keys, ``section`` the actor section's (``policy_loss``);
    ``remove_padding=False``: verl's padded layout; ``strategy``: ``fsdp2`` or ``fsdp``
    (FSDP1)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    fsdp_config = dict(_target_="verl.workers.config.FSDPEngineConfig", mixed_precision=FP32,
                       use_torch_compile=False)
    fsdp_config.update(engine)
    actor = dict(
        _target_="verl.workers.config.FSDPActorConfig", strategy=strategy, rollout_n=3,
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_kl_loss=True,
        kl_loss_coef=0.1, entropy_coeff=0.01, fsdp_config=fsdp_config,
        optim=dict(_target_="verl.workers.config.FSDPOptimizerConfig"),
    )
    actor.update(section or {})
    if prefix_grouper is not None:
        actor.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(actor))
    config.engine.use_remove_padding = remove_padding  # as verl's worker copies it from the model
    config.engine.use_dynamic_bsz = False
    config.engine.micro_batch_size_per_gpu = 2
    return config


def model_config(path: str, **overrides: Any):
    """verl's ``HFModelConfig`` of the saved model (no tokenizer; ``sdpa`` attention)."""
    from verl.workers.config import HFModelConfig

    fields = dict(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"})
    fields.update(overrides)
    return HFModelConfig(**fields)


def engine_class(strategy: str = "fsdp2"):
    """The language-model engine verl selects for ``strategy`` on an NVIDIA GPU."""
    from prefix_sharing.verl_ext.engine import registered_engine

    return registered_engine("language_model", strategy)


def build_engine(config, path: str, **model_fields: Any):
    """The registered engine for ``config``, initialised by verl from the checkpoint at ``path``
    (``model_fields``: ``HFModelConfig`` overrides)."""
    model = model_config(path, use_remove_padding=config.engine.use_remove_padding,
                         **model_fields)
    engine = engine_class(config.strategy)(model, config.engine, config.optim, config.checkpoint)
    with cpu_fsdp1():
        engine.initialize()
    return engine


@contextlib.contextmanager
def cpu_fsdp1() -> Iterator[None]:
    """Within the block FSDP1 broadcasts CPU parameters: verl wraps with
    ``sync_module_states=True`` (only rank 0 loads the checkpoint; the others build the model on
    the meta device and receive rank 0's weights), and torch refuses that broadcast for CPU
    tensors ("requires them to be on GPU") though gloo carries it. Switching
    ``sync_module_states`` off instead would leave ranks other than 0 with uninitialised
    weights. Test support only: on a GPU verl's call runs as is."""
    from torch.distributed.fsdp import _init_utils

    stock = _init_utils._check_module_states_for_sync_module_states
    _init_utils._check_module_states_for_sync_module_states = lambda states: None
    try:
        yield
    finally:
        _init_utils._check_module_states_for_sync_module_states = stock


@contextlib.contextmanager
def verl_float64() -> Iterator[None]:
    """verl's precision names stop at fp32; within the block ``"fp64"`` means ``torch.float64``
    (model dtype, FSDP2's mixed-precision policy). CPU autocast turns itself off at float64
    with a warning, so verl's forward runs in float64 as an fp32 one runs in fp32."""
    import torch
    from verl.utils.torch_dtypes import PrecisionType

    stock = PrecisionType.__dict__["to_dtype"]
    PrecisionType.to_dtype = staticmethod(
        lambda precision: torch.float64 if precision == "fp64" else stock.__func__(precision))
    try:
        yield
    finally:
        PrecisionType.to_dtype = stock


def run(rank: int, path: str, workloads: list[str], modes: dict[str, dict | None],
        dynamic_bsz: int | None = None, *, precision: str = "fp32",
        padded_off: bool = False, padded: bool = False, layout: str = "legacy",
        micro_batch_size: int = 2, batch_order: list[int] | None = None,
        attn_implementation: str = "sdpa", strategy: str = "fsdp2") -> dict:
    """For each workload and sharing setting (name -> ``prefix_grouper`` block, ``None`` for
    the feature off), on a fresh engine from the same checkpoint: ``infer_batch`` outputs (in
    verl's eval mode), ``forward_backward_batch`` outputs with verl's ``ppo_loss`` and every
    gradient, gathered whole (in verl's train mode: gradient checkpointing replays each
    layer), and how often the sharing attention ran. Each rank draws its own batch (seeded by
    rank), so the data-parallel gradient reduction mixes different data. ``dynamic_bsz``:
    verl's token budget per micro-batch (dynamic batch size on) instead of micro-batches of 2.
    ``precision``: ``"fp32"`` or ``"fp64"`` (:func:`verl_float64`). ``padded_off``: the runs
    with the feature off use verl's padded layout (``use_remove_padding=False``, one row per
    sample) instead of its packed row: the reference for a Gated DeltaNet hybrid, whose
    layers run stock over verl's packed row as one sequence (see ``test_fsdp_hybrid``). The
    plain runs compute a hybrid's gated delta rule with
    :func:`prefix_sharing.fsdp_compat.plain_kernels.plain_gdn_kernel` (transformers' torch
    kernel on CPU; the float64 recurrence at float64). ``layout``: the trainer whose batch
    layout the engine gets (``_batch.make_batch``: ``"legacy"`` or verl 0.9's ``"v1"``).
    ``padded``: every run uses verl's padded layout. ``micro_batch_size``: verl's fixed
    micro-batch size; ``batch_order``: the batch's samples in this order (as a trainer's
    balancing may leave them). ``input_rows`` counts the rows of each model call's
    ``input_ids`` (1 for a packed or flat row, the micro-batch's samples when padded).
    ``attn_implementation``: the one verl loads the model with (gpt-oss's sinks: ``"eager"``).
    ``strategy``: verl's FSDP backend, ``"fsdp2"`` or ``"fsdp"`` (FSDP1).
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.fsdp_compat.plain_kernels import plain_gdn_kernel
    from prefix_sharing.verl_ext.mcore import prompt_lengths

    use_cpu_platform()

    def batch(workload, remove_padding):
        data = make_batch(workload, seed=rank, layout=layout, micro_batch_size=micro_batch_size)
        if batch_order is not None:
            data = tu.index_select_tensor_dict(data, batch_order)
        tu.assign_non_tensor(data, use_remove_padding=remove_padding)
        if dynamic_bsz is not None:
            tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=dynamic_bsz)
        return data

    mixed_precision = {"fp32": FP32, "fp64": FP64}[precision]
    override = {"attn_implementation": attn_implementation}
    if precision == "fp64":  # transformers' grouped_mm experts have no float64 kernel
        override["_experts_implementation"] = "eager"
    model_fields = {"override_config": override}
    results = {}
    for workload in workloads:
        for name, prefix_grouper in modes.items():
            packed = not (padded or (padded_off and prefix_grouper is None))
            config = actor_config(prefix_grouper, remove_padding=packed, strategy=strategy,
                                  mixed_precision=mixed_precision, model_dtype=precision)
            with verl_float64():
                engine = build_engine(config, path, **model_fields)
            rows = _count_rows(engine.module)
            with count_sharing_attention() as calls, plain_gdn_kernel(engine.module):
                with engine.eval_mode():
                    infer = engine.infer_batch(batch(workload, packed))
                with engine.train_mode():  # zeroes the gradients on exit: gather them before
                    train = engine.forward_backward_batch(batch(workload, packed),
                                                          partial(ppo_loss, config=config))
                    grads = full_gradients(engine.module)
            results[workload, name] = {
                "infer": plain_output(infer), "train": plain_output(train), "grads": grads,
                "attention_calls": calls["n"], "engine": type(engine).__name__,
                "input_rows": rows,
                # the sharing head scores verl's read window only (_compare.same_outputs)
                "read_from": [n - 1 for n in prompt_lengths(batch(workload, packed))],
            }
    return results


def _count_rows(module) -> list[int]:
    """From now on, the rows of ``input_ids`` each call of ``module`` receives."""
    rows: list[int] = []
    module.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["input_ids"].size(0)), with_kwargs=True)
    return rows


@contextlib.contextmanager
def count_sharing_attention() -> Iterator[collections.Counter]:
    """Counts the calls transformers makes to the sharing attention function (a spy registered
    over it for the block): proof that the model verl built and wrapped runs it."""
    from transformers import AttentionInterface

    from prefix_sharing.fsdp_compat.attention import (ATTENTION_NAME, prefix_sharing_attention,
                                                      register_attention)

    calls = collections.Counter()

    def spy(*args: Any, **kwargs: Any):
        calls["n"] += 1
        return prefix_sharing_attention(*args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, spy)
    try:
        yield calls
    finally:
        register_attention()  # the real function again


def refusals(rank: int, path: str) -> dict[str, str]:
    """What the sharing engine says to each setting it cannot run exactly (error messages)."""
    from verl.utils import tensordict_utils as tu

    from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError

    use_cpu_platform()
    on = {"mode": "arbitrary_prefix"}
    found = {}

    def refused(name, make):
        try:
            make()
        except PrefixSharingSetupError as error:
            found[name] = str(error)

    config = actor_config(on)
    engine = build_engine(config, path)
    mixed = make_batch("grpo", temperature=[0.9, 0.7] * 3)  # two in every micro-batch
    refused("temperatures", lambda: engine.infer_batch(mixed))
    sum_pi_squared = make_batch("grpo")
    tu.assign_non_tensor(sum_pi_squared, calculate_sum_pi_squared=True)
    refused("sum_pi_squared", lambda: engine.infer_batch(sum_pi_squared))
    return found
