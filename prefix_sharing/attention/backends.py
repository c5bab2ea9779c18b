"""Which kernel computes the varlen attention: resolving ``"auto"`` and importing lazily.

Each backend is one function with ``flash_attn_varlen_func(causal=True)``'s signature plus
optional keywords that the kernels needing them read (the others ignore them)::

    fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, *,
       cu_seqlens_q_host=None, cu_seqlens_k_host=None, kernel_cache=None) -> out

and lives in its own module, which imports its kernel package only when called for.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from ..errors import InputError, MissingPackageError

__all__ = [
    "BackendFn",
    "BACKEND_FUNCTIONS",
    "KERNEL_DTYPES",
    "READS_HOST_BOUNDARIES",
    "get_backend",
    "resolve_backend",
]

BackendFn = Callable[..., torch.Tensor]

# backend name -> (module under prefix_sharing.attention, function, kernel package, pip extra)
BACKEND_FUNCTIONS: dict[str, tuple[str, str, str | None, str | None]] = {
    "torch": ("torch_backend", "varlen_attention_torch", None, None),
    "flash_attn": ("flash_attn_backend", "varlen_attention_flash", "flash_attn", "cuda"),
    "te": ("te_backend", "varlen_attention_te", "transformer_engine", "cuda"),
    "npu": ("npu_backend", "varlen_attention_npu", "torch_npu", "npu"),
}
# Kernels that take the segment boundaries as host ints (``cu_seqlens_*_host``): without them
# they copy ``cu_seqlens`` to the host themselves, a device sync in every call.
READS_HOST_BOUNDARIES = frozenset({"torch", "npu"})

_HALF = (torch.float16, torch.bfloat16)
# The q/k/v dtypes each kernel computes in (None: any floating dtype). flash-attn has no float32
# kernel, and Transformer Engine (2.9, 2.10) has no float32 THD kernel; torch_npu's fused
# attention takes float32 too.
KERNEL_DTYPES: dict[str, tuple[torch.dtype, ...] | None] = {
    "torch": None,
    "flash_attn": _HALF,
    "te": _HALF,
    "npu": (*_HALF, torch.float32),
}


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend for ``name`` with q/k/v of ``dtype`` on ``device``.

    ``"auto"`` picks the fastest kernel installed that computes in ``dtype``: on CUDA, float16
    and bfloat16 go to flash-attn, else Transformer Engine, else torch, and float32 to torch;
    on Ascend (``npu``) the fused NPU kernel; elsewhere torch.

    Raises:
        InputError (a ValueError): an unknown name, or a named kernel that does not compute in
            ``dtype``.
    """
    if name == "auto":
        return _auto(device, dtype)
    if name not in BACKEND_FUNCTIONS:
        raise InputError(f"unknown attention backend {name!r}; choose from "
                         f"{', '.join(['auto', *BACKEND_FUNCTIONS])}")
    if not _computes_in(name, dtype):
        kinds = ", ".join(str(d) for d in KERNEL_DTYPES[name])
        raise InputError(
            f"attention backend {name!r} computes in {kinds} only, but q is {dtype}: run the "
            "model in one of those dtypes, or choose backend='torch' (or 'auto')"
        )
    return name


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "npu":
        candidates: tuple[str, ...] = ("npu",)
    elif device.type == "cuda":
        candidates = ("flash_attn", "te")
    else:
        candidates = ()
    for candidate in candidates:
        if _computes_in(candidate, dtype) and (
            device.type == "npu" or _installed(BACKEND_FUNCTIONS[candidate][2])
        ):
            return candidate
    return "torch"


def _computes_in(name: str, dtype: torch.dtype) -> bool:
    kinds = KERNEL_DTYPES[name]
    return kinds is None or dtype in kinds


def get_backend(name: str) -> BackendFn:
    """The kernel function of a concrete backend; a clear :class:`MissingPackageError` (an
    ImportError) when its package is missing."""
    module, function, package, extra = BACKEND_FUNCTIONS[name]
    if package is not None and not _installed(package):
        raise MissingPackageError(
            f"attention backend {name!r} needs the {package!r} package "
            f"(pip install 'prefix-sharing[{extra}]'), or choose backend='torch'"
        )
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None
