"""What stops stock verl on a CPU-only host, each undone at its source (file:line in
``notes/verl-trainer-on-cpu.md``). Every patch is idempotent: verl imports this module once per
process, and the runner's driver may import it again."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import torch

from prefix_sharing.releases import VERL_RELEASES


def verl_release() -> str:
    """The installed verl release, one of :data:`~prefix_sharing.releases.VERL_RELEASES` (the
    releases with patch sets, which this shim knows); anything else raises."""
    from prefix_sharing.refusals import refuse

    version = importlib.metadata.version("verl")
    if version not in VERL_RELEASES:
        raise refuse("verl.cpu_shim_release",
                     f"verl {version}; it knows {' and '.join(VERL_RELEASES)}")
    return version


def install() -> None:
    for patch in RELEASE_PATCHES[verl_release()]:
        patch()
    _rewrite_process_group_backend()
    _register_engines_for_cpu()
    _unpin_cpu_offload()
    _load_value_heads_with_sdpa()


def _register_cpu_platform() -> None:
    """0.9.1 falls back to nvidia without a detected accelerator
    (``plugin/platform/platform_manager.py:113-117``): register ``cpu``, chosen by
    ``VERL_PLATFORM=cpu``. Ray still sees logical GPUs (``ray_init.num_gpus``): placement and
    ``_check_resource_available`` count "GPU", and nothing here touches CUDA."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is not None:
        return

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"
        vendor_name = "cpu"

        @property
        def device_module(self):
            return HostDevice()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return {}


class HostDevice:
    """``torch.cpu`` plus the memory calls verl makes on its device module (memory logs, cache
    flushes): nothing to report or free on the host."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def memory_allocated(*args) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(*args) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def reset_peak_memory_stats(*args) -> None:
        pass

    # checkpoints save and restore the device RNG: on the host it is torch's own generator
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    @staticmethod
    def get_device_name(*args) -> str:
        return "CPU"  # verl's FLOP counter then reports no promised FLOPs (MFU 0)


def _complete_torch_cpu() -> None:
    """0.8.0 has no platform layer: its device module on the host is ``torch.cpu`` itself
    (``utils/device.py:89-104``), which lacks the memory and RNG calls verl makes on it."""
    for name in ("empty_cache", "memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved", "mem_get_info", "reset_peak_memory_stats",
                 "get_rng_state", "set_rng_state", "get_device_name"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, getattr(HostDevice, name))


def _route_unpadding_to_torch() -> None:
    """0.8.0 imports flash_attn off NPU (``utils/attention_utils.py:30``): use verl's pure-torch
    copy of the same four functions."""
    from verl.utils import attention_utils, npu_flash_attn_utils as torch_impl

    attention_utils._get_attention_functions = lambda: (
        torch_impl.index_first_axis, torch_impl.pad_input, torch_impl.rearrange,
        torch_impl.unpad_input)


def _rewrite_process_group_backend() -> None:
    """verl asks for ``cpu:gloo,{device}:{backend}`` (``utils/distributed.py:63,89``): NCCL is not
    built here, and ``cpu:gloo,cpu:gloo`` is a duplicate. Any backend string naming gloo for
    cpu becomes plain gloo; so does 0.8.0's SFT trainer's positional ``"nccl"``
    (``initialize_global_process_group``, ``utils/distributed.py:61``)."""
    init = torch.distributed.init_process_group
    if getattr(init, "_cpu_shim", False):
        return

    @functools.wraps(init)
    def init_process_group(*args, **kwargs):
        if args:  # the backend, positionally
            kwargs["backend"], args = args[0], args[1:]
        backend = kwargs.get("backend")
        if isinstance(backend, str) and ("cpu:gloo" in backend or backend == "nccl"):
            kwargs["backend"] = "gloo"
        return init(*args, **kwargs)

    init_process_group._cpu_shim = True
    torch.distributed.init_process_group = init_process_group


def _register_engines_for_cpu() -> None:
    """verl's engines are registered for cuda and npu only
    (``workers/engine/fsdp/transformer_impl.py:1143,1594`` in 0.9.1; the Megatron engines for
    cuda): register for "cpu" the class verl selects on an NVIDIA GPU, through verl's own
    decorator. That is prefix-sharing's engine where its patch set registered one (0.9.1
    registers it under vendor keys beside verl's, which a device key for "cpu" copied from
    "cuda" would miss). The Megatron engines where megatron-core is installed."""
    from verl.workers.engine import EngineRegistry

    from prefix_sharing.verl_ext.engine import registered_engine

    # importing an engine module registers its engines
    importlib.import_module("verl.workers.engine.fsdp.transformer_impl")
    if importlib.util.find_spec("megatron.core") is not None:
        importlib.import_module("verl.workers.engine.megatron.transformer_impl")
    for model_type, backends in EngineRegistry._engines.items():
        for backend, by_key in backends.items():
            if "cuda" in by_key and "cpu" not in by_key:
                engine = registered_engine(model_type, backend)
                EngineRegistry.register(model_type, backend, device="cpu")(engine)


def _unpin_cpu_offload() -> None:
    """The reference model forces ``CPUOffloadPolicy(pin_memory=True)``
    (``transformer_impl.py:462``), which needs an accelerator: pin only when one exists."""
    from verl.workers.engine.fsdp import transformer_impl

    policy = getattr(transformer_impl, "CPUOffloadPolicy", None)
    if policy is None or getattr(policy, "_cpu_shim", False):
        return
    pin = torch.cuda.is_available() or importlib.util.find_spec("torch_npu") is not None

    def cpu_offload_policy(*args, **kwargs):
        kwargs["pin_memory"] = kwargs.get("pin_memory", True) and pin
        return policy(*args, **kwargs)

    cpu_offload_policy._cpu_shim = True
    transformer_impl.CPUOffloadPolicy = cpu_offload_policy


def load_value_head_on_cpu(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's ``load_valuehead_model`` (``utils/model.py``: the critic's token classifier with
    one label) with transformers' ``sdpa`` attention: verl asks for flash-attention 2, which has
    no CPU kernel, and falls back to trl's value head only where trl is installed. A checkpoint
    without a value head (a language model's) gets one initialised from a fixed seed, so that
    two runs compared start from the same critic (verl leaves it to the process's RNG)."""
    from transformers import AutoModelForTokenClassification

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return AutoModelForTokenClassification.from_pretrained(
            local_path, torch_dtype=torch_dtype, config=model_config, attn_implementation="sdpa",
            trust_remote_code=trust_remote_code)


def _load_value_heads_with_sdpa() -> None:
    """The critic loads through :func:`load_value_head_on_cpu` (verl imports
    ``load_valuehead_model`` from its module at call time)."""
    from verl.utils import model

    model.load_valuehead_model = load_value_head_on_cpu


# What each release in VERL_RELEASES lacks on a CPU host, before the patches all need.
RELEASE_PATCHES = {
    "0.9.1": (_register_cpu_platform,),
    "0.8.0": (_route_unpadding_to_torch, _complete_torch_cpu),
}
