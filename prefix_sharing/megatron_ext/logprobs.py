"""Token log-probs and entropy from a ``GPTModel``'s vocab-parallel logits.

Under tensor parallelism each rank holds a slice of the vocabulary; the per-row shift, softmax
denominator, expected logit and picked target logit are all-reduced across the tensor-parallel
group in the forward (two all-reduces per call). The backward needs no communication (see
:mod:`prefix_sharing.logprobs`). Rows are still read through the plan's ``kv_index``, so
nothing of size ``(T_total, vocab)`` is built on any rank.

:func:`lm_head_inputs` and :func:`head_token_stats` skip the logits altogether: the model
returns the output layer's input, and the head runs inside the scoring, in chunks of rows, on
this rank's vocabulary slice (:mod:`prefix_sharing.head_logprobs`) - nothing of size
``(T_flat, V_local)`` either (verl's ``use_fused_kernels``).

Under context parallelism each rank holds the logits of its slice of the flat rows, and one
all-reduce completes every position on every rank; the vocabulary slice and that completion
live in :mod:`.vocab_parallel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from megatron.core.utils import get_attr_wrapped_model, unwrap_model

from ..head_logprobs import hidden_token_stats
from ..logprobs import TokenStats
from .model_check import check_sharing_model
from .packed_seq import MicroBatch
from .vocab_parallel import (MegatronVocabShard, context_parallel_token_stats,
                             rows_token_stats, vocab_shard)

__all__ = ["MegatronVocabShard", "context_parallel_token_stats", "token_stats", "forward_token_stats",
           "vocab_shard", "lm_head_inputs", "LMHead", "head_token_stats"]


def token_stats(
    logits: torch.Tensor,
    batch: MicroBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_parallel: bool = True,
) -> TokenStats:
    """Per-token log-probs and entropy of every sequence of ``batch`` (packed, given order).

    Args:
        logits: ``GPTModel``'s output on the last pipeline stage, ``[1, T_flat, V_local]``.
        batch: the micro-batch the logits were computed for.
        temperature: logits are divided by it first (verl's rollout temperature).
        with_entropy: also compute the entropy.
        vocab_parallel: the logits are split over the tensor-parallel group (``GPTModel``'s
            default ``parallel_output=True``); ignored when that group has one rank.
    """
    if logits.dim() == 3:
        if logits.size(0) != 1:
            raise ValueError(f"THD logits have batch size 1; got shape {tuple(logits.shape)}")
        logits = logits[0]  # [1, T, V] -> [T, V]
    shard = vocab_shard(logits.size(-1)) if vocab_parallel else None
    return rows_token_stats(logits, batch.plan, batch.cp, temperature=temperature,
                            with_entropy=with_entropy, vocab_shard=shard)


def forward_token_stats(
    model: torch.nn.Module,
    batch: MicroBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> TokenStats:
    """Runs a micro-batch through a whole (single-stage) ``GPTModel`` and returns its token stats.

    With pipeline parallelism, call the model in your ``forward_step_func`` and
    :func:`token_stats` in its loss function on the last stage.
    """
    check_sharing_model(model)
    max_len = get_attr_wrapped_model(model, "max_sequence_length")
    longest = max(batch.plan.seq_lens)
    if max_len is not None and longest > max_len:
        raise ValueError(
            f"a sequence of {longest} tokens is longer than the model allows "
            f"(max_sequence_length={max_len})"
        )
    logits = model(batch.input_ids, batch.position_ids, None,
                   packed_seq_params=batch.packed_seq_params)
    return token_stats(logits, batch, temperature=temperature, with_entropy=with_entropy)


@dataclasses.dataclass
class LMHead:
    """The output layer's weight (this rank's vocabulary slice; the tied embedding's when the
    model shares it), recorded by :func:`lm_head_inputs` when the model called its head."""

    weight: torch.Tensor | None = None


@contextlib.contextmanager
def lm_head_inputs(model: torch.nn.Module) -> Iterator[LMHead]:
    """Within the block, ``GPTModel``'s output layer returns its input instead of logits, so the
    model returns ``[1, T, hidden]`` (every flat row on every tensor-parallel rank), and the
    yielded :class:`LMHead` holds the weight it was called with.

    The input goes through the same tensor-parallel mapping the column-parallel head applies:
    gathered from the sequence-parallel region (the backward reduce-scatters), or copied into
    the tensor-parallel region (the backward all-reduces) - each rank's gradient of the rows
    covers its vocabulary slice only, so the ranks' shares must be summed, as for the head's
    own matrix product. ``model``: the (wrapped) ``GPTModel`` of the last pipeline stage.
    """
    layer = unwrap_model(model).output_layer
    head = LMHead()

    def head_input(hidden: torch.Tensor, weight: torch.Tensor | None = None,
                   **_: Any) -> tuple[torch.Tensor, None]:
        head.weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden), None
        return copy_to_tensor_model_parallel_region(hidden), None

    layer.forward = head_input
    try:
        yield head
    finally:
        del layer.forward  # the class's forward again


def head_token_stats(
    hidden: torch.Tensor,
    head: LMHead,
    batch: MicroBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> TokenStats:
    """:func:`token_stats` from the model's output under :func:`lm_head_inputs` (``[1, T_flat,
    hidden]``): the head runs in chunks of rows on this rank's vocabulary slice, each flat row
    that a position reads scored once (:func:`prefix_sharing.head_logprobs.hidden_token_stats`).
    Not under context parallelism (each rank would hold a slice of the rows)."""
    if batch.cp is not None:
        raise ValueError("head_token_stats covers the whole flat layout; under context "
                         "parallelism use token_stats")
    if head.weight is None:
        raise ValueError("the model did not call its output layer under lm_head_inputs")
    return hidden_token_stats(hidden[0], head.weight, batch.plan, temperature=temperature,
                              with_entropy=with_entropy,
                              vocab_shard=vocab_shard(head.weight.size(0)))
