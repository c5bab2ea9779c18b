"""Drives verl's real value-model engines (the critic) in-process on CPU, as verl's critic
worker does: the critic config through verl's own conversion (``FSDPCriticConfig`` /
``McoreCriticConfig`` with ``use_prefix_grouper`` / ``prefix_grouper``), the value-model engine
verl's registry selects, ``infer_batch`` (the values ``compute_values`` reads) and
``forward_backward_batch`` with verl's ``value_loss``, every gradient gathered whole.

The checkpoint is a seeded Qwen2 token classifier with one label, the layout verl loads a
critic into (``load_valuehead_model``); verl asks for flash-attention there, which does not
run on CPU: :func:`cpu_value_head` loads it with the ``sdpa`` attention instead, as the CPU
trainer shim does (test support only). The batches are the actor tests' (``_batch.make_batch``), plus each response's old
values and returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from ._batch import PRESET, make_batch, plain_output, use_cpu_platform
from ._fsdp_engine import FP32, cpu_fsdp1, model_config

WORKLOADS = ("grpo", "tree")


def save_value_model(directory: str, seed: int = 0) -> str:
    """A seeded Qwen2 token classifier with one label (verl's critic layout), of the tiny
    preset's shape, saved where verl will load it."""
    from transformers import AutoModelForTokenClassification

    from prefix_sharing.fsdp_compat import build_model

    config = build_model("qwen2", PRESET, seed=seed).config
    config.num_labels = 1
    config.architectures = ["Qwen2ForTokenClassification"]
    torch.manual_seed(seed)
    AutoModelForTokenClassification.from_config(config).save_pretrained(directory)
    return directory


@contextlib.contextmanager
def cpu_value_head() -> Iterator[None]:
    """Within the block verl's ``load_valuehead_model`` loads the token classifier with the
    ``sdpa`` attention (verl's own asks for flash-attention 2, which has no CPU kernel)."""
    from verl.utils import model as verl_model

    from prefix_sharing.testing.verl_cpu.patches import load_value_head_on_cpu

    stock = verl_model.load_valuehead_model
    verl_model.load_valuehead_model = load_value_head_on_cpu
    try:
        yield
    finally:
        verl_model.load_valuehead_model = stock


def critic_config(prefix_grouper: dict | None, strategy: str = "fsdp2", **megatron: Any):
    """verl's ``FSDPCriticConfig`` (or ``McoreCriticConfig`` for ``strategy="megatron"``,
    ``megatron``: its engine settings, e.g. ``tensor_model_parallel_size``) built the way the
    trainer builds it (OmegaConf -> dataclass), with the critic's sharing keys when
    ``prefix_grouper`` is given."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = dict(strategy=strategy, rollout_n=3, ppo_mini_batch_size=4,
                   ppo_micro_batch_size_per_gpu=2, cliprange_value=0.2)
    if strategy == "megatron":
        section.update(_target_="verl.workers.config.McoreCriticConfig", megatron=dict(
            _target_="verl.workers.config.McoreEngineConfig", use_mbridge=True,
            vanilla_mbridge=True, **megatron))
    else:
        section.update(
            _target_="verl.workers.config.FSDPCriticConfig",
            fsdp=dict(_target_="verl.workers.config.FSDPEngineConfig", mixed_precision=FP32,
                      use_torch_compile=False),
            optim=dict(_target_="verl.workers.config.FSDPOptimizerConfig"))
    if prefix_grouper is not None:
        section.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(section))
    config.engine.use_remove_padding = True  # as verl's worker copies it from the model
    config.engine.use_dynamic_bsz = False
    config.engine.micro_batch_size_per_gpu = 2
    return config


def critic_batch(workload: str, seed: int, budget: int | None = None):
    """The actor tests' batch of ``workload`` with each response's old values and returns;
    with ``budget``, split by verl's dynamic batch size under that token budget per GPU (the
    cross-micro-batch tests' agent batch: ``"agent"``)."""
    from verl.utils import tensordict_utils as tu

    from .test_cross_forward import AGENT

    data = make_batch(workload, seed=seed, **(AGENT if workload == "agent" else {}))
    if budget is not None:
        tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
    gen = torch.Generator().manual_seed(seed + 2)
    for key in ("values", "returns"):  # padded (bsz, response) like the advantages
        data[key] = torch.rand(data["advantages"].shape, generator=gen)
    return data


def run_fsdp(rank: int, path: str, modes: dict[str, dict | None], *,
             strategy: str = "fsdp2", control: bool = False,
             workloads: tuple[str, ...] = WORKLOADS, budget: int | None = None) -> dict:
    """Per workload and mode (name -> ``prefix_grouper`` block, ``None`` for sharing off), on a
    fresh critic engine from the same checkpoint: ``infer_batch`` values, the step's value loss
    and every gradient. ``control``: the sharing runs read each value one flat row too early
    (an injected bug the comparison must catch). ``budget``: the batch split under that many
    tokens (verl's dynamic batch size)."""
    from verl.workers.utils.losses import value_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from prefix_sharing.verl_ext import fsdp as sharing_fsdp
    from prefix_sharing.verl_ext.engine import registered_engine

    use_cpu_platform()
    results = {}
    with values_shifted(sharing_fsdp, control):
        for workload in workloads:
            for name, prefix_grouper in modes.items():
                config = critic_config(prefix_grouper, strategy)
                model = model_config(path, use_remove_padding=True, model_type="value_model")
                engine = registered_engine("value_model", strategy)(
                    model, config.engine, config.optim, config.checkpoint)
                with cpu_fsdp1(), cpu_value_head():
                    engine.initialize()
                with engine.eval_mode():
                    infer = engine.infer_batch(critic_batch(workload, rank, budget))
                with engine.train_mode():
                    train = engine.forward_backward_batch(critic_batch(workload, rank, budget),
                                                          partial(value_loss, config=config))
                    grads = full_gradients(engine.module)
                results[workload, name] = {"infer": plain_output(infer),
                                           "train": plain_output(train), "grads": grads,
                                           "engine": type(engine).__name__}
    return results


@contextlib.contextmanager
def values_shifted(engine_module: Any, control: bool) -> Iterator[None]:
    """With ``control``, within the block the sharing engine of ``engine_module`` (:mod:`.fsdp`
    or :mod:`.mcore`, where ``restore_values`` is looked up) reads each value one flat row too
    early: the injected bug the tests' comparison must catch."""
    stock = engine_module.restore_values
    if control:
        engine_module.restore_values = lambda flat, plan: stock(flat.roll(1), plan)
    try:
        yield
    finally:
        engine_module.restore_values = stock


class ValueHead(torch.nn.Linear):
    """A one-output linear head over the last hidden states, called as megatron's GPTModel
    calls its output layer (what verl's ``make_value_model`` puts there: values in fp32, no
    tensor-parallel split; under sequence parallelism each rank scores its slice of the rows,
    the values are gathered over the tensor-parallel group and the weight's gradient is summed
    over it as a sequence-parallel parameter's)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__(hidden_size, 1, bias=False)
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        from megatron.core import tensor_parallel

        values = super().forward(hidden).float()
        if self.sequence_parallel:
            values = tensor_parallel.gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False)
        return values, None


def run_megatron(rank: int, modes: dict[str, dict | None], *, control: bool = False,
                 workloads: tuple[str, ...] = WORKLOADS, budget: int | None = None) -> dict:
    """:func:`run_fsdp` on verl's Megatron value-model engine: the actor tests' tiny GPTModel
    (``_engine.build_engine``) with a seeded :class:`ValueHead` as its output layer. The
    engine's ``tensor_model_parallel_size`` and ``pipeline_model_parallel_size`` are megatron's
    (``run_distributed(..., tp=, pp=)``; the head on the last stage), with sequence
    parallelism above TP=1; the sequence-parallel gradients are then summed over the
    tensor-parallel group, as megatron's ``finalize_model_grads`` does. Every rank draws the
    same batch (one data-parallel rank), split under ``budget`` tokens when given."""
    from megatron.core import parallel_state
    from verl.workers.utils.losses import value_loss

    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads
    from prefix_sharing.verl_ext import mcore as sharing_mcore

    from ._engine import build_engine

    use_cpu_platform()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=True) if tp > 1 else {}
    if pp > 1:
        parallel["pipeline_model_parallel_size"] = pp
    results = {}
    with values_shifted(sharing_mcore, control):
        for workload in workloads:
            for name, prefix_grouper in modes.items():
                config = critic_config(prefix_grouper, "megatron", **parallel)
                engine = build_engine(config, model_type="value_model", sequence_parallel=tp > 1)
                model = engine.module[0]
                torch.manual_seed(1)
                if model.post_process:  # the last pipeline stage's
                    model.output_layer = ValueHead(model.config.hidden_size, tp > 1)
                model.share_embeddings_and_output_weights = False
                infer = engine.infer_batch(critic_batch(workload, 0, budget))
                train = engine.forward_backward_batch(critic_batch(workload, 0, budget),
                                                      partial(value_loss, config=config))
                finalize_sequence_parallel_grads(model)
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                results[workload, name] = {"infer": plain_output(infer),
                                           "train": plain_output(train), "grads": grads,
                                           "engine": type(engine).__name__}
    return results


def compare(shared: dict, plain: dict, rtol: float = 1e-5, *, last_stage: bool = True
            ) -> list[str]:
    """Where ``shared`` differs from ``plain`` beyond ``rtol`` (relative to the plain run's
    largest magnitude): each sample's values, the step's summed loss, every gradient (on a
    pipeline stage before the last, ``last_stage=False``: its gradients only)."""
    def far(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool((a - b).abs().max() > rtol * b.abs().max().clamp(min=1e-6))

    found = [f"grad {name}" for name, grad in plain["grads"].items()
             if far(shared["grads"][name], grad)]
    if not last_stage:
        return found
    values_s = shared["infer"]["model_output"]["values"]
    values_p = plain["infer"]["model_output"]["values"]
    assert len(values_s) == len(values_p) and values_p, "different or no samples"
    found += [f"values[{i}]" for i, (s, p) in enumerate(zip(values_s, values_p))
              if s.shape != p.shape or far(s, p)]
    loss_s, loss_p = sum(shared["train"]["loss"]), sum(plain["train"]["loss"])
    assert plain["train"]["loss"], "no losses"
    if abs(loss_s - loss_p) > rtol * max(abs(loss_p), 1e-6):
        found.append("loss")
    return found


def refusals(rank: int, path: str) -> dict[str, Any]:
    """The critic's own refusals at construction: Ulysses, and the self-check."""
    from prefix_sharing.errors import PrefixSharingSetupError
    from prefix_sharing.verl_ext.engine import registered_engine

    use_cpu_platform()
    found = {}
    for name, block, engine_fields in (
            ("ulysses", {"mode": "arbitrary_prefix"}, {"ulysses_sequence_parallel_size": 2}),
            ("self_check", {"mode": "arbitrary_prefix", "self_check": True}, {})):
        config = critic_config(block)
        for key, value in engine_fields.items():
            object.__setattr__(config.engine, key, value)
        model = model_config(path, use_remove_padding=True, model_type="value_model")
        try:
            registered_engine("value_model", "fsdp2")(model, config.engine, config.optim,
                                                     config.checkpoint)
        except PrefixSharingSetupError as error:
            found[name] = list(error.refusals)
    return found
