"""A HuggingFace causal LM that returns log-probs and entropy instead of logits.

:func:`install_hidden_state_head` wraps one model instance's ``forward``: called with a
:class:`HeadRequest` under :data:`HEAD_KWARG`, it runs the base model (``model.model``, the
decoder with its final norm, as transformers' own causal-LM forward does), takes the last hidden
states of the plan's flat layout and scores them with the model's LM head through
:func:`prefix_sharing.head_logprobs.hidden_token_stats`: chunks of rows, the read window only,
no ``(T_flat, vocab)`` logits in the forward or the backward. Without the keyword it is the
forward it replaced.

The scoring runs as a call of the head module itself (its ``forward`` is wrapped the same way):
FSDP's hooks on the head then gather its weight for the forward, gather it again for the
backward and reduce-scatter its gradient, as for the model's own logits. verl 0.9.1 wraps an
untied ``lm_head`` in its own FSDP2 unit; its fused kernels
(``verl/models/transformers/dense_common.py``, ``forward_with_torch_backend``) read
``lm_head.weight`` outside the head's call and meet the sharded parameter there.

Only a plain linear head can be computed this way: a model that scales or soft-caps its final
logits, or whose forward returns router statistics (``output_router_logits``: the MoE causal-LM
forward adds ``router_logits`` and ``aux_loss``), keeps its own forward and the caller scores
its logits (:func:`head_problem`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Sequence
from typing import Any

import torch

from ..head_logprobs import hidden_token_stats
from ..logprobs import TokenStats
from ..plan import SharingPlan
from .vlm import text_config

__all__ = ["HEAD_KWARG", "HeadOutput", "HeadRequest", "head_problem", "install_hidden_state_head"]

HEAD_KWARG = "prefix_sharing_head"
# config fields of a final-logit transformation that a plain linear head would skip
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclasses.dataclass(frozen=True)
class HeadRequest:
    """What to score in one forward.

    Attributes:
        plan: the micro-batch's plan (the model runs on its flat layout).
        temperature: the logits are divided by it.
        with_entropy: also compute the entropy.
        read_from: per sequence, the first position read (``None``: all);
            see :func:`prefix_sharing.head_logprobs.read_positions`.
        chunk_rows: rows per chunk (``None``: the module's default).
    """

    plan: SharingPlan
    temperature: float = 1.0
    with_entropy: bool = True
    read_from: Sequence[int] | None = None
    chunk_rows: int | None = None


@dataclasses.dataclass
class HeadOutput:
    """The wrapped forward's output: ``(T_total,)`` log-probs and entropy (``None`` without
    ``with_entropy``), packed per sequence in the plan's order, 0 outside the read window."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None

    @property
    def stats(self) -> TokenStats:
        return TokenStats(self.log_probs, self.entropy)


def head_problem(model: torch.nn.Module, *, ignore_logit_transform: bool = False) -> str | None:
    """Why ``model``'s logits are not ``hidden @ lm_head.weight.T (+ bias)`` (``None`` when they
    are): an LM head that is not a linear layer, or (unless ``ignore_logit_transform``: verl's
    fused kernels skip it too) a final soft-cap or logit scale in its config."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"its LM head is a {type(head).__name__}, not a linear layer"
    config = text_config(model.config)
    if getattr(config, "output_router_logits", False):  # transformers' MoE causal-LM forward
        return ("it returns router statistics (output_router_logits: router_logits, aux_loss), "
                "which the head's output does not carry")
    if ignore_logit_transform:
        return None
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return f"it transforms its final logits ({name}={value})"
    return None


def install_hidden_state_head(model: torch.nn.Module, *,
                              ignore_logit_transform: bool = False) -> torch.nn.Module:
    """Wraps ``model.forward`` in place (this instance only; call before FSDP wraps it) so that a
    call with ``prefix_sharing_head=HeadRequest(...)`` returns a :class:`HeadOutput`; returns
    ``model``. Raises ``ValueError`` for a model :func:`head_problem` names."""
    problem = head_problem(model, ignore_logit_transform=ignore_logit_transform)
    if problem is not None:
        raise ValueError(f"{type(model).__name__}: {problem}; score its logits instead")
    previous = model.forward  # transformers' (or verl's) forward, for calls without a request

    @functools.wraps(previous)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        request = kwargs.pop(HEAD_KWARG, None)
        if request is None:
            return previous(*args, **kwargs)
        # the decoder under the causal LM; transformers 4.57's Gemma 3 text model names its
        # prefix "language_model" but holds it as `model`, which get_decoder() returns
        base = getattr(self, self.base_model_prefix, None)
        if base is None:
            base = self.get_decoder()
        hidden = base(*args, **kwargs).last_hidden_state
        return HeadOutput(*self.get_output_embeddings()(hidden[0], request))  # [T_flat, hidden]

    head = model.get_output_embeddings()
    previous_head = head.forward

    @functools.wraps(previous_head)
    def head_forward(self: torch.nn.Linear, hidden: torch.Tensor,
                     request: HeadRequest | None = None) -> Any:
        if request is None:
            return previous_head(hidden)
        return tuple(hidden_token_stats(hidden, self.weight, request.plan, bias=self.bias,
                                        temperature=request.temperature,
                                        with_entropy=request.with_entropy,
                                        read_from=request.read_from,
                                        chunk_rows=request.chunk_rows))

    model.forward = types.MethodType(forward, model)
    head.forward = types.MethodType(head_forward, head)
    return model
