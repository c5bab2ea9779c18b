"""The critic: verl's value-model engines (``FSDPEngineWithValueHead``,
``MegatronEngineWithValueHead``) with each micro-batch's shared prefixes computed once.

A value model's output at position ``t`` depends on tokens ``0..t`` only, so a sample's value at
``t`` is the output of the flat row that computed its token ``t`` - its own row, or the
provider's for a position inside a shared prefix - exactly as a log-prob's hidden state is found
(:meth:`prefix_sharing.plan.SharingPlan.restore`; the backward sums into the shared rows). The
sharing engines of the actor serve the critic as one more consumer: the same subclass over
verl's value-head engine (:mod:`.fsdp`, :mod:`.mcore_engine`), the same config keys in the
``critic:`` section (:mod:`.config`), and :func:`restore_values` where the actor's engine
scores tokens.

A group across micro-batches (Megatron engine) reads values out where the actor reads
log-probs (:class:`.cross_state.Readout`): a block's values kept as leaves, their readers'
gradients carried into the block by its backward step. What the critic refuses on top of the
actor's refusals (:func:`value_head_problems`): a sequence split over ranks (FSDP's Ulysses,
Megatron's context parallelism), where each rank holds only some of the flat rows a sample's
values come from, and the first-step self-check, which compares log-probs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..refusals import Refused
from .config import sharing_config

__all__ = ["restore_values", "value_head_problems"]


def restore_values(flat: torch.Tensor, plan: Any) -> torch.Tensor:
    """Per-sample values, a jagged nested ``(bsz, j1)`` tensor in the plan's sample order (verl's
    ``values`` output), from the model's value per flat row (``flat``: ``(T_flat,)``, the plan's
    padding rows included)."""
    return torch.nested.as_nested_tensor(plan.split(plan.restore(flat)), layout=torch.jagged)


def value_head_problems(engine_config: Any) -> list[Refused]:
    """What a sharing critic refuses beyond the actor's (see the module doc)."""
    found = []
    for setting in ("ulysses_sequence_parallel_size", "context_parallel_size"):
        size = getattr(engine_config, setting, 1) or 1
        if size > 1:
            found.append(Refused("verl.critic.sequence_split", f"critic {setting}={size}"))
    if sharing_config(engine_config).self_check:
        found.append(Refused("verl.self_check.value_model",
                             "critic.prefix_grouper.self_check=true"))
    return found
