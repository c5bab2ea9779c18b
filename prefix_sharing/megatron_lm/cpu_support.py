"""Run Megatron-LM's ``pretrain()`` on a CPU-only torch with gloo (tests, CI, laptops).

On top of :func:`prefix_sharing.megatron_ext.cpu_support.enable_cpu_megatron` (megatron-core's
hard-coded CUDA), Megatron-LM's training loop needs four more redirections, each commented with
the code that needs it. Like that function, it is for CPU-only processes and cannot be undone
(``torch.nn.Module.cuda`` becomes a no-op); it refuses to run where CUDA is available.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["enable_cpu_megatron_lm"]

_enabled = False


def enable_cpu_megatron_lm() -> None:
    """Redirect Megatron-LM's training loop to the CPU, once per process (see the module doc).

    Raises:
        RuntimeError: if CUDA is available (as ``enable_cpu_megatron``).
    """
    global _enabled
    from ..megatron_ext.cpu_support import enable_cpu_megatron

    enable_cpu_megatron()
    if _enabled:
        return
    from megatron.training import arguments, training

    # arguments.validate_args asks the GPU's architecture (get_device_arch_version, which reads
    # cuda:0's properties) under tensor parallelism: a CPU is not Blackwell, so answer 0 and keep
    # the pre-Blackwell rules (CUDA_DEVICE_MAX_CONNECTIONS=1 is still asked for).
    arguments.get_device_arch_version = lambda: 0

    # training.pretrain calls initialize_megatron() without allow_no_cuda, which asserts CUDA.
    training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                     allow_no_cuda=True)
    # training.get_model moves every model chunk with .cuda(torch.cuda.current_device()); the
    # model is built on the CPU already (use_cpu_initialization), where it stays.
    torch.nn.Module.cuda = lambda self, device=None: self
    # initialize._initialize_distributed sets up model parallelism only when
    # torch.cuda.device_count() > 0, and otherwise calls torch.cuda.set_device before
    # init_process_group: the process group is started here (gloo, from torchrun's environment),
    # so that branch is skipped, and one "device" is reported.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo")
    torch.cuda.device_count = lambda: 1
    _enabled = True
