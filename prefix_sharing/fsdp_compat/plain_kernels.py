"""The recurrences the *plain* (reference) runs of the hybrids compute with: the gated delta rule
of Qwen3.5 / Qwen3-Next and the Mamba-2 scan of Nemotron-H.

transformers' GDN layers call a module-level ``torch_chunk_gated_delta_rule`` (5.24), or the
kernel each layer bound at construction, ``self.chunk_gated_delta_rule`` (4.57 and 5.10: fla's
``chunk_gated_delta_rule`` when installed, else that torch function). fla's kernel is Triton
(CUDA only: on CPU it fails) and transformers' torch code computes in float32 even for a
float64 model. Neither serves a CPU equivalence check, so for the duration of a plain run
:func:`plain_gdn_kernel` rebinds that name in the model's modeling module, and each layer's own
binding where it has one:

- float64 model: the token-by-token recurrence
  (:func:`prefix_sharing.recurrent.torch_kernels.gated_delta_rule_recurrent`) in float64, so the
  higher-precision reference is float64 inside the recurrence too;
- otherwise, on CPU: transformers' own torch implementation (the function under its
  kernel-hub decorator), as it runs without fla;
- on an accelerator at low precision: left alone.

Nemotron-H's Mamba-2 mixers call a module-level ``mamba2_chunk_scan`` the same way (bound to
mamba_ssm's kernel when installed, else a torch scan that computes in float32 even for a float64
model); :func:`plain_ssd_kernel` rebinds it alike: the float64 token-by-token SSD recurrence
(:func:`prefix_sharing.recurrent.ssd_torch.ssd_recurrent`) for a float64 model, transformers'
own torch scan otherwise on CPU, left alone on an accelerator at low precision.

Everything else in the plain run - projections, convolution, norms, attention, padding masks -
stays transformers' own code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..recurrent.batch_major import gated_delta_rule_batch_major
from ..recurrent.ssd_torch import ssd_recurrent

__all__ = ["plain_gdn_kernel", "plain_ssd_kernel"]

_NAME = "torch_chunk_gated_delta_rule"
_BOUND_NAME = "chunk_gated_delta_rule"  # a layer's own binding (transformers 4.57, 5.10)
_SSD_NAME = "mamba2_chunk_scan"
# transformers' call (batch-major, each row one sequence) on the token-by-token recurrence
_RECURRENCE_FLOAT64 = functools.partial(gated_delta_rule_batch_major, token_by_token=True)


@contextlib.contextmanager
def plain_gdn_kernel(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s GDN layers (if any) use the kernel described above."""
    with _rebound(model, "GatedDeltaNet", _NAME, _RECURRENCE_FLOAT64, bound_name=_BOUND_NAME):
        yield


@contextlib.contextmanager
def plain_ssd_kernel(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s Mamba-2 mixers (if any) use the scan described above."""
    with _rebound(model, "Mamba2Mixer", _SSD_NAME, _ssd_recurrence_float64):
        yield


@contextlib.contextmanager
def _rebound(model: torch.nn.Module, class_suffix: str, name: str, float64_kernel: Any,
             bound_name: str | None = None) -> Iterator[None]:
    """Rebinds ``name`` in the modeling module of ``model``'s ``*class_suffix`` layers, and
    each layer's own ``bound_name`` attribute where it has one."""
    layers = [m for m in model.modules() if type(m).__name__.endswith(class_suffix)]
    module = _modeling_module(layers[0]) if layers else None
    dtype = next(model.parameters()).dtype
    if module is None or not hasattr(module, name) or (
            dtype != torch.float64 and next(model.parameters()).device.type != "cpu"):
        yield
        return
    original = getattr(module, name)
    kernel = float64_kernel if dtype == torch.float64 else inspect.unwrap(original)
    bound = [m for m in layers if bound_name is not None and bound_name in vars(m)]
    saved = [vars(m)[bound_name] for m in bound]
    setattr(module, name, kernel)
    for layer in bound:
        setattr(layer, bound_name, kernel)
    try:
        yield
    finally:
        setattr(module, name, original)
        for layer, kept in zip(bound, saved, strict=True):
            setattr(layer, bound_name, kept)


def _modeling_module(gdn: torch.nn.Module) -> Any:
    """The transformers module defining the GDN class (a sharing subclass defers to its base)."""
    for cls in type(gdn).__mro__:
        if cls.__module__.startswith("transformers."):
            return sys.modules[cls.__module__]
    return None


def _ssd_recurrence_float64(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                            B: torch.Tensor, C: torch.Tensor, chunk_size: int,
                            D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                            initial_states: torch.Tensor | None = None,
                            dt_softplus: bool = False,
                            dt_limit: tuple[float, float] = (0.0, float("inf")),
                            return_final_states: bool = False, **_: Any) -> Any:
    """transformers' ``mamba2_chunk_scan`` call (batch-major ``[B, T, H, P]``, each row one
    sequence; ``dt`` raw) on the float64 token-by-token recurrence."""
    batch, length = hidden_states.shape[:2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    flat = [t.reshape(batch * length, *t.shape[2:]).double() for t in (hidden_states, dt, B, C)]
    out, final = ssd_recurrent(*flat[:2], A.double(), *flat[2:], D=D, initial_state=initial_states,
                               cu_seqlens_host=range(0, batch * length + 1, length))
    out = out.view(batch, length, *out.shape[1:])
    return (out, final) if return_final_states else out
