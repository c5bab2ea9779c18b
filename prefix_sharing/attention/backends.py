"""Which kernel computes the varlen attention: resolving ``"auto"`` and importing lazily.

Each backend is one function with ``flash_attn_varlen_func(causal=True)``'s signature plus
optional keywords that the kernels needing them read (the others ignore them)::

    fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, *,
       cu_seqlens_q_host=None, cu_seqlens_k_host=None, kernel_cache=None) -> out

and lives in its own module, which imports its kernel package only when called for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

from ..kernel_backends import KernelBackends, Package

__all__ = [
    "BackendFn",
    "BACKEND_FUNCTIONS",
    "CAUSAL_KEYS_ONLY_SEGMENTS",
    "KERNEL_DTYPES",
    "READS_HOST_BOUNDARIES",
    "ROW_KEY_BOUNDS",
    "check_no_row_bounds",
    "host_boundaries",
    "LSE_KERNELS",
    "get_backend",
    "get_lse_kernel",
    "resolve_backend",
]

BackendFn = Callable[..., torch.Tensor]

# backend name -> (module under prefix_sharing.attention, function, kernel package, pip extra)
BACKEND_FUNCTIONS: dict[str, tuple[str, str, str | None, str | None]] = {
    "torch": ("torch_backend", "varlen_attention_torch", None, None),
    "flash_attn": ("flash_attn_backend", "varlen_attention_flash", "flash_attn", "cuda"),
    "te": ("te_backend", "varlen_attention_te", "transformer_engine", "cuda"),
    "npu": ("npu_backend", "varlen_attention_npu", "torch_npu", "npu"),
    "flex": ("flex_backend", "varlen_attention_flex", None, None),
}
# backend name -> (module, forward, backward) of its with-lse pair: the forward returns
# ``(out, lse)`` (lse ``(nheads, total_q)`` float32, natural log, flash-attn's ``softmax_lse``),
# the backward takes the output and log-sum-exp to differentiate at (see
# :mod:`.merge`). Attention over key sources runs on these; a backend without one is served
# by the gather (:mod:`.sources`).
LSE_KERNELS: dict[str, tuple[str, str, str]] = {
    "torch": ("torch_backend", "attention_lse_torch", "attention_lse_backward_torch"),
    "flash_attn": ("flash_attn_backend", "attention_lse_flash", "attention_lse_backward_flash"),
    "npu": ("npu_backend", "attention_lse_npu", "attention_lse_backward_npu"),
    "te": ("te_backend", "attention_lse_te", "attention_lse_backward_te"),
}
# With-lse kernels whose causal calls take segments with keys but no queries (rows read by
# nobody, K/V left in place): torch's (it skips them), torch_npu's (its calls leave them out).
# flash-attn documents no such segment for causal calls: a layout that needs them (a
# context-parallel slice's own pieces, :func:`.sources.source_layout`) gathers there instead.
CAUSAL_KEYS_ONLY_SEGMENTS = frozenset({"torch", "npu"})
# With-lse kernels that take a per-row first key in non-causal calls (``first_key``): a sliding
# window over a shared node, whose readers stack in one segment at different distances from it.
# flash-attn's, TE's and torch_npu's bands are one ``(left, right)`` per call: where a window
# cuts a node, they are served by the trimmed gather (:mod:`.sources`).
ROW_KEY_BOUNDS = frozenset({"torch"})
# Kernels that take the segment boundaries as host ints (``cu_seqlens_*_host``): without them
# they copy ``cu_seqlens`` to the host themselves, a device sync in every call. FlexAttention
# builds its mask from them.
READS_HOST_BOUNDARIES = frozenset({"torch", "npu", "flex"})


def host_boundaries(cu_seqlens: torch.Tensor, host: Sequence[int] | None) -> Sequence[int]:
    """Segment boundaries as host ints, for those kernels: ``host`` when the caller has them
    (every layer of a planned micro-batch: the plan's), else read from ``cu_seqlens`` (a
    standalone call; a device sync)."""
    return cu_seqlens.tolist() if host is None else host


def check_no_row_bounds(name: str, first_key: torch.Tensor | None) -> None:
    """Raises for a with-lse kernel outside :data:`ROW_KEY_BOUNDS` handed ``first_key``."""
    if first_key is not None:
        raise ValueError(f"the {name!r} kernel takes one band per call, not a first key per "
                         "row: a layout with windows over shared nodes runs on "
                         f"{sorted(ROW_KEY_BOUNDS)}")


_HALF = (torch.float16, torch.bfloat16)
# The q/k/v dtypes each kernel computes in (None: any floating dtype). flash-attn has no float32
# kernel, and Transformer Engine (2.9, 2.10) has no float32 THD kernel; torch_npu's fused
# attention takes float32 too.
KERNEL_DTYPES: dict[str, tuple[torch.dtype, ...] | None] = {
    "torch": None,
    "flash_attn": _HALF,
    "te": _HALF,
    "npu": (*_HALF, torch.float32),
    "flex": None,
}


# The family's resolver (:mod:`prefix_sharing.kernel_backends`): "auto" on CUDA tries flash-attn,
# then Transformer Engine; on Ascend the fused NPU kernel (an "npu" device exists only once
# torch_npu is imported); elsewhere torch.
_BACKENDS = KernelBackends(
    kind="attention backend",
    packages={
        name: None if package is None else Package(
            package, f"the {package!r} package", f"pip install 'prefix-sharing[{extra}]'")
        for name, (_, _, package, extra) in BACKEND_FUNCTIONS.items()
    },
    auto={"cuda": ("flash_attn", "te"), "npu": ("npu",)},
    dtypes={name: kinds for name, kinds in KERNEL_DTYPES.items() if kinds is not None},
    native=frozenset({"npu"}),
)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend for ``name`` with q/k/v of ``dtype`` on ``device``.

    ``"auto"`` picks the fastest kernel installed that computes in ``dtype``: on CUDA, float16
    and bfloat16 go to flash-attn, else Transformer Engine, else torch, and float32 to torch;
    on Ascend (``npu``) the fused NPU kernel; elsewhere torch.

    Raises:
        InputError (a ValueError): an unknown name, or a named kernel that does not compute in
            ``dtype``.
    """
    return _BACKENDS.resolve(name, device, dtype)


def get_backend(name: str) -> BackendFn:
    """The kernel function of a concrete backend; a clear :class:`MissingPackageError` (an
    ImportError) when its package is missing."""
    _BACKENDS.require(name)
    module, function, _, _ = BACKEND_FUNCTIONS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def get_lse_kernel(name: str) -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                                       Callable[..., tuple[torch.Tensor, ...]]] | None:
    """The ``(forward, backward)`` with-lse pair of a concrete backend (:data:`LSE_KERNELS`),
    or ``None`` where the backend has none."""
    if name not in LSE_KERNELS:
        return None
    _BACKENDS.require(name)
    module, forward, backward = LSE_KERNELS[name]
    loaded = importlib.import_module(f"{__package__}.{module}")
    return getattr(loaded, forward), getattr(loaded, backward)
