"""Switching a stock transformers module, in place, to a subclass whose forward reads the plan.

A recurrent mixer (Gated DeltaNet, Mamba-2) is its own forward: nothing in it reads a plan, and
run stock on the flat layout it would carry one sequence's state into the next segment. Its
sharing subclass replaces ``forward`` only, so the module keeps its parameters, names and hooks
(switch before FSDP wraps the model); a stock one left in a sharing model is refused. The
sharing forwards check their call alike (:func:`planned_mixer_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..plan import SharingPlan
from ..recurrent import RecurrenceSchedule, recurrence_schedule
from ..refusals import refuse
from .attention import BACKEND_KWARG, PLAN_KWARG

__all__ = ["InPlaceSwitch", "planned_mixer_inputs"]


class InPlaceSwitch:
    """One kind of module and its sharing ``forward``: switches modules of that kind and finds
    stock ones left in a model.

    Args:
        kind: what the modules are, for the refusal ("Gated DeltaNet modules").
        is_kind: whether a module is of that kind (stock or switched).
        forward: the sharing subclass's ``forward``.
        marker: the class attribute (``True``) that marks a switched module.
        method: the method ``forward`` replaces (a VLM's ``get_image_features``).
    """

    def __init__(self, kind: str, is_kind: Callable[[torch.nn.Module], bool],
                 forward: Callable[..., object], marker: str, method: str = "forward") -> None:
        self.kind, self.is_kind, self.forward, self.marker = kind, is_kind, forward, marker
        self.method = method
        self._classes: dict[type, type] = {}

    def is_switched(self, module: torch.nn.Module) -> bool:
        return getattr(module, self.marker, False)

    def switch(self, module: torch.nn.Module) -> bool:
        """Switches ``module`` if it is a stock one of this kind; returns whether it did."""
        if self.is_switched(module) or not self.is_kind(module):
            return False
        stock = type(module)
        if stock not in self._classes:
            self._classes[stock] = type(f"PrefixSharing{stock.__name__}", (stock,),
                                        {self.method: self.forward, self.marker: True,
                                         "__module__": self.forward.__module__})
        module.__class__ = self._classes[stock]
        return True

    def stock_left(self, model: torch.nn.Module) -> str | None:
        """The stock modules of this kind left in ``model``, as "stock <kind> (names)"; ``None``
        when there are none."""
        stock = [name for name, m in model.named_modules()
                 if self.is_kind(m) and not self.is_switched(m)]
        if not stock:
            return None
        return f"stock {self.kind} ({', '.join(stock[:3]) + (', ...' if len(stock) > 3 else '')})"

    def check(self, model: torch.nn.Module) -> None:
        """Raises when a stock (recurrent) module of this kind is left in ``model``."""
        stock = self.stock_left(model)
        if stock:
            raise refuse("hf.stock_recurrent_module", stock)


def planned_mixer_inputs(module: Any, kind: str, hidden_states: torch.Tensor, cache: Any,
                         attention_mask: torch.Tensor | None,
                         kwargs: Mapping[str, Any]) -> tuple[RecurrenceSchedule, str]:
    """What a switched recurrent mixer's forward runs on: the plan's recurrence schedule and
    the kernel backend (``"torch"`` when the forward asked for torch, else ``"auto"``).

    Raises ``ValueError`` for a call the flat layout cannot serve: no plan among ``kwargs``, a
    cache or a padding mask, hidden states that are not one row of tokens ``(1, T_flat, h)``.
    ``kind`` names the mixer in the message (``"Mamba-2 mixer"``).
    """
    plan = kwargs.get(PLAN_KWARG)
    if not isinstance(plan, SharingPlan):
        raise ValueError(f"layer {module.layer_idx}'s sharing {kind} needs the micro-batch's "
                         f"plan: call the model with {PLAN_KWARG}=plan (shared_forward does)")
    if cache is not None or attention_mask is not None:
        raise ValueError(f"the sharing {kind} takes no cache (use_cache=False) and no "
                         "attention_mask (the plan lays out unpadded sequences)")
    if hidden_states.dim() != 3 or hidden_states.size(0) != 1:
        raise ValueError(f"the flat layout is one row of tokens; got {tuple(hidden_states.shape)}")
    backend = "torch" if kwargs.get(BACKEND_KWARG) == "torch" else "auto"
    return recurrence_schedule(plan), backend
