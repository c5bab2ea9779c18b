"""Drives verl 0.9.1's real Megatron engine in-process on CPU (no Ray), as a verl worker would.

Per rank (spawned by ``run_distributed``, which sets up megatron on gloo): select a CPU platform
in ``verl.plugin.platform``, build the actor config through verl's own config conversion
(``McoreActorConfig``, with ``prefix_grouper``), instantiate the registered language-model engine
with the tiny preset's GPTModel injected (verl's ``initialize()`` would load HF weights), then
run ``infer_batch`` (old log-probs) and ``train_batch``'s core, ``forward_backward_batch`` with
verl's ``ppo_loss``, on a batch laid out as verl's trainer lays it out (left-padded prompts,
right-padded responses, then ``left_right_2_no_padding``).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from prefix_sharing.workloads import make_workload



def _import_verl_engine() -> None:
    """Imports verl's Megatron engine (patched on import) in a rank where megatron's CPU
    redirections already replaced ``torch.cuda.Stream`` by a function: transformers 5.10, which
    verl imports, writes ``torch.cuda.Stream | None`` in annotations at import time."""
    stream = torch.cuda.Stream
    if not isinstance(stream, type):
        torch.cuda.Stream = type("Stream", (), {})
    try:
        import verl.workers.engine.megatron.transformer_impl  # noqa: F401
    finally:
        torch.cuda.Stream = stream


_import_verl_engine()

from ..megatron_ext._distributed import PRESET

WORKLOADS = {
    "grpo": dict(num_prompts=2, group_size=3),
    "steprl": dict(num_chains=1, num_steps=4),
    "tree": dict(depth=2, branching=2),
    "agent": dict(num_tasks=1, num_turns=2, branching=2),
}


def use_cpu_platform() -> None:
    """verl assumes nvidia without a platform; a CUDA platform whose device calls are CPU no-ops.
    verl 0.8.0 has no platform plugin; its unpadding imports flash_attn (CUDA): route it to
    verl's pure-torch copy of the same functions."""
    import importlib.util

    if importlib.util.find_spec("verl.plugin") is None:
        from verl.utils import attention_utils, npu_flash_attn_utils as torch_impl

        attention_utils._get_attention_functions = lambda: (
            torch_impl.index_first_axis, torch_impl.pad_input, torch_impl.rearrange,
            torch_impl.unpad_input)
        return
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"

        def current_device(self):
            return "cpu"

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def empty_cache(self):
            pass

    platform_manager.set_platform(PlatformCPU())


def actor_config(prefix_grouper: dict | None, **overrides: Any):
    """verl's ``McoreActorConfig`` built the way the worker builds it (OmegaConf -> dataclass)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = dict(
        _target_="verl.workers.config.McoreActorConfig", rollout_n=3, ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
        megatron=dict(_target_="verl.workers.config.McoreEngineConfig", use_mbridge=True,
                      vanilla_mbridge=True), **overrides,
    )
    if prefix_grouper is not None:
        section.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(section))
    config.engine.use_remove_padding = True
    config.engine.use_dynamic_bsz = False
    config.engine.micro_batch_size_per_gpu = 2
    return config


def build_engine(config, *, seed: int = 0, preset=PRESET):
    """The registered megatron language-model engine for ``config``, tiny model injected."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from verl.workers.engine.base import EngineRegistry

    from prefix_sharing.engines.megatron import gpt_model
    from prefix_sharing.megatron_ext import get_gpt_layer_local_spec as shared_spec

    engine_cls = EngineRegistry._engines["language_model"]["megatron"]["cuda"]
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False), model_type="language_model",
    )
    engine = engine_cls(model_config, config.engine, config.optim, config.checkpoint)
    # The vanilla-mbridge hook, as _build_tf_config leaves it: the bridge builds its layer spec
    # lazily. Megatron's stock local spec cannot run packed sequences on CPU, the project's
    # core attention can: the plain engine runs it without a plan.
    engine.provider = None
    engine.bridge = SimpleNamespace(_get_transformer_layer_spec=lambda vp_stage=None: get_gpt_layer_local_spec())
    if getattr(engine, "prefix_sharing", None) is not None and engine.prefix_sharing.enabled:
        from prefix_sharing.verl_ext.verl091 import install_layer_spec
        install_layer_spec(engine)
        spec = engine.bridge._get_transformer_layer_spec()
    else:
        spec = shared_spec()
    model = gpt_model(preset, seed=seed, layer_spec=spec)
    engine.module, engine.tf_config, engine.is_value_model = [model], model.config, False
    return engine


def make_batch(workload: str, *, seed: int = 0, micro_batch_size: int = 2, vocab_size: int | None = None,
               **sizes: Any):
    """A verl no-padding batch of the workload (sizes: :data:`WORKLOADS`, or ``sizes``);
    a sample's prompt is its group's prompt."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    wl = make_workload(workload, vocab_size=vocab_size or PRESET.vocab_size, seed=seed,
                       **(sizes or WORKLOADS[workload]))
    prompt_len = {m: g.prompt_len for g in wl.groups for m in g.members}
    uid = {m: f"u{i}" for i, g in enumerate(wl.groups) for m in g.members}
    n = len(wl.sequences)
    prompts = [s[: prompt_len[i]] for i, s in enumerate(wl.sequences)]
    responses = [s[prompt_len[i]:] for i, s in enumerate(wl.sequences)]
    max_p, max_r = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(n, max_p + max_r, dtype=torch.long)
    attention_mask = torch.zeros(n, max_p + max_r, dtype=torch.long)
    response_mask = torch.zeros(n, max_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, max_p - len(p): max_p], input_ids[i, max_p: max_p + len(r)] = p, r
        attention_mask[i, max_p - len(p): max_p + len(r)] = 1
        response_mask[i, : len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed + 1)
    data = TensorDict(dict(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
        position_ids=position_ids, prompts=input_ids[:, :max_p], responses=input_ids[:, max_p:],
        temperature=torch.full((n,), 0.9),
        old_log_probs=-torch.rand(n, max_r, generator=gen) * response_mask,
        ref_log_prob=-torch.rand(n, max_r, generator=gen) * response_mask,
        advantages=torch.rand(n, max_r, generator=gen) * response_mask,
    ), batch_size=[n])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, uid=[uid[i] for i in range(n)], calculate_entropy=True,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size,
                         global_batch_size=n)
    return data


def run(rank: int, workloads: list[str], modes: dict[str, dict | None]) -> dict:
    """For each workload and each sharing setting (name -> ``prefix_grouper`` block or ``None``
    for the feature off): old log-probs + entropy (``infer_batch``), then ``ppo_loss`` and every
    gradient (``forward_backward_batch``), each on a fresh copy of the same seeded model."""
    from verl.workers.utils.losses import ppo_loss

    use_cpu_platform()
    results = {}
    for workload in workloads:
        for name, prefix_grouper in modes.items():
            config = actor_config(prefix_grouper)
            engine = build_engine(config)
            infer = engine.infer_batch(make_batch(workload))
            train = engine.forward_backward_batch(make_batch(workload), partial(ppo_loss, config=config))
            grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
            results[workload, name] = {"infer": _plain(infer), "train": _plain(train), "grads": grads}
    return results


def _plain(output: dict) -> dict:
    """Picklable copy: nested tensors as lists of per-sample tensors."""
    if not output:
        return {}
    model_output = {k: [t.detach().clone() for t in v.unbind()] for k, v in output["model_output"].items()}
    metrics = {k: [_number(x) for x in (v if isinstance(v, list) else [v])]
               for k, v in output.get("metrics", {}).items()}
    return {"model_output": model_output, "loss": [float(x) for x in output.get("loss", [])],
            "metrics": metrics}


def _number(metric: Any) -> float:
    if hasattr(metric, "aggregate"):  # verl's Metric
        return float(metric.aggregate())
    return float(metric)
