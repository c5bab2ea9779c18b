"""Which kernel computes the varlen attention: resolving ``"auto"`` and importing lazily.

Each backend is one function with ``flash_attn_varlen_func(causal=True)``'s signature::

    fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale) -> out

and lives in its own module, which imports its kernel package only when called for.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

__all__ = ["BackendFn", "BACKEND_FUNCTIONS", "get_backend", "resolve_backend"]

BackendFn = Callable[..., torch.Tensor]

# backend name -> (module under prefix_sharing.attention, function, kernel package, pip extra)
BACKEND_FUNCTIONS: dict[str, tuple[str, str, str | None, str | None]] = {
    "torch": ("torch_backend", "varlen_attention_torch", None, None),
    "flash_attn": ("flash_attn_backend", "varlen_attention_flash", "flash_attn", "cuda"),
    "te": ("te_backend", "varlen_attention_te", "transformer_engine", "cuda"),
    "npu": ("npu_backend", "varlen_attention_npu", "torch_npu", "npu"),
}


def resolve_backend(name: str, device: torch.device) -> str:
    """The concrete backend for ``name`` on ``device``; ``"auto"`` picks the fastest installed.

    ``"auto"``: on CUDA flash-attn, else Transformer Engine, else torch; on Ascend (``npu``)
    the fused NPU kernel; elsewhere torch.
    """
    if name != "auto":
        if name not in BACKEND_FUNCTIONS:
            raise ValueError(f"unknown attention backend {name!r}; choose from "
                             f"{', '.join(['auto', *BACKEND_FUNCTIONS])}")
        return name
    if device.type == "cuda":
        for candidate in ("flash_attn", "te"):
            if _installed(BACKEND_FUNCTIONS[candidate][2]):
                return candidate
        return "torch"
    if device.type == "npu":
        return "npu"
    return "torch"


def get_backend(name: str) -> BackendFn:
    """The kernel function of a concrete backend; a clear ImportError when its package is missing."""
    module, function, package, extra = BACKEND_FUNCTIONS[name]
    if package is not None and not _installed(package):
        raise ImportError(
            f"attention backend {name!r} needs the {package!r} package "
            f"(pip install 'prefix-sharing[{extra}]'), or choose backend='torch'"
        )
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None
