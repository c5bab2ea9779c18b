"""A group's prefix K/V, kept per layer across its suffix micro-batches.

The prefix micro-batch's core attention *records* each layer's keys and values; every suffix
micro-batch's core attention *reads* them as leaves (detached tensors that require grad),
placed before its own rows, so its backward accumulates dK/dV into the leaves' ``.grad``. After
the group's last suffix, :meth:`PrefixKV.backward` sends those sums into the prefix's graph.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["PrefixKV"]

Mode = Literal["record", "read"]


class PrefixKV:
    """Per-layer prefix K/V (this rank's K/V heads), keyed by megatron's ``layer_number``.

    Attributes:
        mode: ``"record"`` while the prefix micro-batch runs, ``"read"`` while a suffix runs.
        leaves: ``layer_number -> (k, v)``, each ``[Lp, ng, hn]``, detached, requiring grad.
        outputs: ``layer_number -> (k, v)`` of the last recorded pass, still in its graph
            when it ran with grad: the tensors :meth:`backward` differentiates.
    """

    def __init__(self) -> None:
        self.mode: Mode = "record"
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def exchange(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer's attention uses: its own while recording (kept),
        ``cat(prefix leaves, own)`` (``[Lp + T, ng, hn]``) while reading."""
        if self.mode == "record":
            self.outputs[layer_number] = (key, value)
            if layer_number not in self.leaves:  # a recompute keeps the leaves and their grads
                self.leaves[layer_number] = (_leaf(key), _leaf(value))
            return key, value
        k_leaf, v_leaf = self.leaves[layer_number]
        return torch.cat([k_leaf, key]), torch.cat([v_leaf, value])

    def held_bytes(self) -> int:
        """Bytes held across the group: the leaves and their accumulated gradients
        (2 x layers x Lp x K/V heads x head dim each, this rank)."""
        tensors = [t for kv in self.leaves.values() for t in kv]
        grads = [t.grad for t in tensors if t.grad is not None]
        return sum(t.numel() * t.element_size() for t in tensors + grads)

    def backward(self, extra: list[torch.Tensor] | None = None) -> None:
        """Backward of the recorded pass with the accumulated dK/dV as incoming gradients,
        plus ``extra`` scalar losses of that pass (e.g. its own tokens' loss terms)."""
        tensors: list[torch.Tensor] = list(extra or [])
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        for layer, outs in self.outputs.items():
            for out, leaf in zip(outs, self.leaves[layer]):
                if leaf.grad is not None and out.requires_grad:
                    tensors.append(out)
                    grads.append(leaf.grad)
        if not tensors:
            raise RuntimeError("nothing to backpropagate: the prefix pass ran without grad")
        torch.autograd.backward(tensors, grads)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)
