"""Counting device-to-host reads on CPU, where they cost nothing but still happen.

On a GPU every read of a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``,
``nonzero`` ...) stalls the host until the device catches up. Two counters:

- Python-level reads of a tensor's value (a torch function mode): ``item``, ``tolist``,
  ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``numpy``;
- operators that read a value back (a torch dispatch mode, which also sees the backward):
  ``aten._local_scalar_dense`` (what ``.item()`` and friends lower to) and the operators whose
  output shape depends on tensor values, which synchronize a CUDA device (``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_host_reads"]

_VALUE_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy,
}
_aten = torch.ops.aten
_SYNCING_OPS = {
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_consecutive.default, _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,
}


class _CountValueReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func in _VALUE_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _CountSyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SYNCING_OPS and not (
            func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None
        ):
            self.count += 1
        return func(*args, **kwargs)


def count_host_reads(step: Callable[[], None]) -> dict[str, int]:
    """Runs ``step`` under both counters; returns what each saw."""
    with _CountValueReads() as reads, _CountSyncingOps() as ops:
        step()
    return {"value_reads": reads.count, "syncing_ops": ops.count}
