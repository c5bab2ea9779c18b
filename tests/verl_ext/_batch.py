"""What every verl engine test needs, whichever engine: verl on CPU, and batches laid out as
verl's trainer lays them out. Imports no engine (the FSDP ranks never load megatron)."""

from __future__ import annotations

from typing import Any

import torch

from prefix_sharing.presets import PRESETS
from prefix_sharing.workloads import make_workload

PRESET = PRESETS["tiny"]  # 2 layers, hidden 64, 4 query heads over 2 K/V groups, vocab 512

WORKLOADS = {
    "grpo": dict(num_prompts=2, group_size=3),
    "steprl": dict(num_chains=1, num_steps=4),
    "tree": dict(depth=2, branching=2),
    "agent": dict(num_tasks=1, num_turns=2, branching=2),
}


def use_cpu_platform() -> None:
    """verl assumes nvidia without a platform; a CUDA platform whose device calls are CPU no-ops.
    verl 0.8.0 has no platform plugin; its unpadding imports flash_attn (CUDA): route it to
    verl's pure-torch copy of the same functions; its device module on the host is ``torch.cpu``,
    which lacks the ``empty_cache`` its FSDP1 parameter initialisation calls."""
    import importlib.util

    if importlib.util.find_spec("verl.plugin") is None:
        from verl.utils import attention_utils, npu_flash_attn_utils as torch_impl

        attention_utils._get_attention_functions = lambda: (
            torch_impl.index_first_axis, torch_impl.pad_input, torch_impl.rearrange,
            torch_impl.unpad_input)
        if not hasattr(torch.cpu, "empty_cache"):
            torch.cpu.empty_cache = _HostDevice.empty_cache
        return
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"

        @property
        def device_module(self):
            return _HostDevice()

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


class _HostDevice:
    """``torch.cpu`` plus the memory calls verl makes on its device module (its memory log
    during ``initialize()``, cache flushes): nothing to report or free on the host."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_allocated(*args: Any) -> int:
        return 0

    memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(*args: Any) -> tuple[int, int]:
        return 0, 0


def make_batch(workload: str, *, seed: int = 0, micro_batch_size: int = 2,
               vocab_size: int | None = None, temperature: float | list[float] = 0.9,
               layout: str = "legacy", even_lengths: bool = False, **sizes: Any):
    """A verl no-padding batch of the workload (sizes: :data:`WORKLOADS`, or ``sizes``);
    a sample's prompt is its group's prompt; ``temperature`` per sample or one for all.

    ``layout``: ``"legacy"``, as verl's legacy trainer (0.8.0's, 0.9's ``use_v1: false``)
    hands it to the engines (a padded batch through ``left_right_2_no_padding``); ``"v1"``, as
    0.9's v1 trainer does (:func:`v1_batch`: every field per sample, from TransferQueue).
    ``even_lengths``: each sample one token shorter where its length is odd (verl's stock
    step pads samples to a multiple of TP, and megatron's router counts those pad rows)."""
    wl = make_workload(workload, vocab_size=vocab_size or PRESET.vocab_size, seed=seed,
                       **(sizes or WORKLOADS[workload]))
    if even_lengths:
        wl.sequences[:] = [s[: len(s) - len(s) % 2] for s in wl.sequences]
    prompt_len = {m: g.prompt_len for g in wl.groups for m in g.members}
    uid = {m: f"u{i}" for i, g in enumerate(wl.groups) for m in g.members}
    n = len(wl.sequences)
    prompts = [s[: prompt_len[i]] for i, s in enumerate(wl.sequences)]
    responses = [s[prompt_len[i]:] for i, s in enumerate(wl.sequences)]
    temperatures = torch.as_tensor(temperature, dtype=torch.float32).expand(n).clone()
    gen = torch.Generator().manual_seed(seed + 1)
    terms = {key: [-torch.rand(len(r), generator=gen) for r in responses]
             for key in ("old_log_probs", "ref_log_prob")}
    terms["advantages"] = [torch.rand(len(r), generator=gen) for r in responses]
    uids = [uid[i] for i in range(n)]
    build = {"legacy": legacy_batch, "v1": v1_batch}[layout]
    data = build(prompts, responses, uids, temperatures, terms)
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, calculate_entropy=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=micro_batch_size, global_batch_size=n)
    return data


def legacy_batch(prompts, responses, uids, temperatures, terms, positions=None,
                 multi_modal_inputs=None):
    """The legacy trainer's layout: left-padded prompts, right-padded responses, through
    ``left_right_2_no_padding`` (which keeps the padded masks); uid a NonTensorStack.
    A VLM batch (``positions``: each sample's ``(4, L_i)`` rows, text over mrope, as verl's
    dataset computes them; ``multi_modal_inputs``: its dict or ``None``, a NonTensorStack)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    n = len(prompts)
    max_p, max_r = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(n, max_p + max_r, dtype=torch.long)
    attention_mask = torch.zeros(n, max_p + max_r, dtype=torch.long)
    response_mask = torch.zeros(n, max_r, dtype=torch.long)
    padded = {key: torch.zeros(n, max_r) for key in terms}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, max_p - len(p): max_p], input_ids[i, max_p: max_p + len(r)] = p, r
        attention_mask[i, max_p - len(p): max_p + len(r)] = 1
        response_mask[i, : len(r)] = 1
        for key, values in terms.items():
            padded[key][i, : len(r)] = values[i]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if positions is not None:  # (n, 4, width), zero on the padding
        position_ids = torch.zeros(n, 4, max_p + max_r, dtype=torch.long)
        for i, (p, rows) in enumerate(zip(prompts, positions)):
            position_ids[i, :, max_p - len(p): max_p - len(p) + rows.size(1)] = rows
    data = TensorDict(dict(
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
        position_ids=position_ids, prompts=input_ids[:, :max_p], responses=input_ids[:, max_p:],
        temperature=temperatures, **padded,
    ), batch_size=[n])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, uid=uids)
    if multi_modal_inputs is not None:
        tu.assign_non_tensor(data, multi_modal_inputs=multi_modal_inputs)
    return data


def v1_batch(prompts, responses, uids, temperatures, terms):
    """The v1 trainer's layout (verl 0.9): each sample's fields as its agent loop stores them
    in TransferQueue (``verl/trainer/ppo/v1/agent_loop_tq.py``: ``prompts``, ``responses``,
    their concatenation ``input_ids``, an all-ones ``attention_mask``, ``position_ids``,
    ``response_mask``, the ``uid``; the trainer writes the per-response loss terms back as
    nested tensors), packed into one TensorDict field by field with TransferQueue's own
    ``AsyncSimpleStorageManager._pack_field_values`` (what its storage returns to a worker: jagged
    nested tensors, a NonTensorStack of uids); the sampling temperature rides as
    batch-level extra info."""
    from tensordict import TensorDict
    from transfer_queue.storage.managers.simple_storage_manager import (
        AsyncSimpleStorageManager as SimpleStorageManager)
    from verl.utils import tensordict_utils as tu

    samples = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids = torch.cat([p, r]).long()
        samples.append(dict(
            prompts=p.long(), responses=r.long(), input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids), position_ids=torch.arange(len(input_ids)),
            response_mask=torch.ones(len(r), dtype=torch.long), uid=uids[i],
            **{key: values[i] for key, values in terms.items()},
        ))
    pack = SimpleStorageManager._pack_field_values
    data = TensorDict({key: pack([s[key] for s in samples]) for key in samples[0]},
                      batch_size=[len(samples)])
    data["loss_mask"] = data["response_mask"]
    assert temperatures.unique().numel() == 1, "the v1 trainer has one temperature per batch"
    tu.assign_non_tensor_data(data, "temperature", float(temperatures[0]))
    return data


def plain_output(output: dict) -> dict:
    """A picklable copy of an engine's output: nested tensors as lists of per-sample tensors,
    verl's metrics as floats (a list of them where the engine gave a list: verl's worker
    requires lists)."""
    if not output:
        return {}
    model_output = {k: [t.detach().clone() for t in v.unbind()]
                    for k, v in output["model_output"].items()}
    metrics = {k: [_number(x) for x in v] if isinstance(v, list) else _number(v)
               for k, v in output.get("metrics", {}).items()}  # lists stay lists
    return {"model_output": model_output, "loss": [float(x) for x in output.get("loss", [])],
            "metrics": metrics}


def _number(metric: Any) -> float:
    if hasattr(metric, "aggregate"):  # verl's Metric
        return float(metric.aggregate())
    return float(metric)
