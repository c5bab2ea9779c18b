"""Peak bytes of the activations autograd saves for backward, measured while a run executes.

On CPU there is no allocator peak to read, and saved activations are what a micro-batch's
size drives. Every tensor autograd saves is counted once per storage (parameters excluded)
from the moment it is saved until the graph that holds it is freed; the peak of that sum is
the run's activation memory.
"""

from __future__ import annotations

import torch


class SavedActivations:
    """Context manager; ``peak`` is the largest number of saved bytes alive at once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> object:
        # a jagged nested tensor (verl's per-sample outputs) holds its rows in values()
        storage = (t.values() if t.is_nested else t).untyped_storage()
        key = storage.data_ptr()
        if key in self.params or storage.nbytes() == 0:
            return t
        return _Saved(self, t, key, storage.nbytes())

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def add(self, key: int, nbytes: int) -> None:
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.refs[key] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes


class _Saved:
    """One saved tensor; released (``__del__``) when autograd frees the graph holding it."""

    def __init__(self, meter: SavedActivations, tensor: torch.Tensor, key: int,
                 nbytes: int) -> None:
        self.tensor, self.meter, self.key, self.nbytes = tensor, meter, key, nbytes
        meter.add(key, nbytes)

    def __del__(self) -> None:
        self.meter.release(self.key, self.nbytes)
