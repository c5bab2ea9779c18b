"""The gated delta rule the *plain* (reference) runs of Qwen3.5 / Qwen3-Next compute with.

transformers' GDN layers call a module-level ``torch_chunk_gated_delta_rule``, which transformers
binds at import to flash-linear-attention's Triton kernel when ``fla`` is installed (CUDA only:
on CPU it fails) and otherwise to its own torch code, which computes in float32 even for a
float64 model. Neither serves a CPU equivalence check, so for the duration of a plain run
:func:`plain_gdn_kernel` rebinds that name in the model's modeling module:

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
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..recurrent.batch_major import gated_delta_rule_batch_major

__all__ = ["plain_gdn_kernel"]

_NAME = "torch_chunk_gated_delta_rule"
# transformers' call (batch-major, each row one sequence) on the token-by-token recurrence
_RECURRENCE_FLOAT64 = functools.partial(gated_delta_rule_batch_major, token_by_token=True)


@contextlib.contextmanager
def plain_gdn_kernel(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s GDN layers (if any) use the kernel described above."""
    gdn = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    module = None if gdn is None else _modeling_module(gdn)
    dtype = next(model.parameters()).dtype
    if module is None or not hasattr(module, _NAME) or (
            dtype != torch.float64 and next(model.parameters()).device.type != "cpu"):
        yield
        return
    original = getattr(module, _NAME)
    setattr(module, _NAME, _RECURRENCE_FLOAT64 if dtype == torch.float64
            else inspect.unwrap(original))
    try:
        yield
    finally:
        setattr(module, _NAME, original)


def _modeling_module(gdn: torch.nn.Module) -> Any:
    """The transformers module defining the GDN class (a sharing subclass defers to its base)."""
    for cls in type(gdn).__mro__:
        if cls.__module__.startswith("transformers."):
            return sys.modules[cls.__module__]
    return None
