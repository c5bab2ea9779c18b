"""The gated delta rule the *plain* (reference) runs of Qwen3.5 / Qwen3-Next compute with.

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

Everything else in the plain run - projections, convolution, norms, attention, padding masks -
stays transformers' own code.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..recurrent.torch_kernels import gated_delta_rule_recurrent

__all__ = ["plain_gdn_kernel"]

_NAME = "torch_chunk_gated_delta_rule"
_BOUND_NAME = "chunk_gated_delta_rule"  # a layer's own binding (transformers 4.57, 5.10)


@contextlib.contextmanager
def plain_gdn_kernel(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s GDN layers (if any) use the kernel described above."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    module = _modeling_module(layers[0]) if layers else None
    dtype = next(model.parameters()).dtype
    if module is None or not hasattr(module, _NAME) or (
            dtype != torch.float64 and next(model.parameters()).device.type != "cpu"):
        yield
        return
    original = getattr(module, _NAME)
    kernel = _recurrence_float64 if dtype == torch.float64 else inspect.unwrap(original)
    bound = [m for m in layers if _BOUND_NAME in vars(m)]  # transformers 4.57 / 5.10
    saved = [vars(m)[_BOUND_NAME] for m in bound]
    setattr(module, _NAME, kernel)
    for layer in bound:
        setattr(layer, _BOUND_NAME, kernel)
    try:
        yield
    finally:
        setattr(module, _NAME, original)
        for layer, kept in zip(bound, saved, strict=True):
            setattr(layer, _BOUND_NAME, kept)


def _modeling_module(gdn: torch.nn.Module) -> Any:
    """The transformers module defining the GDN class (a sharing subclass defers to its base)."""
    for cls in type(gdn).__mro__:
        if cls.__module__.startswith("transformers."):
            return sys.modules[cls.__module__]
    return None


def _recurrence_float64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        g: torch.Tensor, beta: torch.Tensor, *, initial_state=None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        **_: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' call (batch-major ``[B, T, H, K]``, each row one sequence) on the float64
    token-by-token recurrence."""
    batch, length = query.shape[:2]
    flat = [x.reshape(batch * length, *x.shape[2:]).double() for x in (query, key, value, g, beta)]
    out, final = gated_delta_rule_recurrent(
        *flat, initial_state=initial_state, cu_seqlens_host=range(0, batch * length + 1, length),
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out.view(batch, length, *out.shape[1:]).to(value.dtype), (
        final if output_final_state else None)
