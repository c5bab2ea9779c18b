"""The Megatron engine: a GPTModel of a preset's shape, run plain and shared on the same weights.

Three ways to compute the same micro-batches, all through megatron's own schedule
(``get_forward_backward_func``, so pipeline parallelism runs exactly as in training):

- ``"shared"``: the prefix-sharing layer spec on the plan's flat layout;
- ``"packed"``: the same model on megatron's stock THD layout (plain ``PackedSeqParams``,
  verl's packing: nothing shared, megatron's own THD RoPE) - what a training step computes
  today, and the baseline ``bench`` times;
- ``"padded"``: megatron's stock local spec on right-padded ``[b, s]`` input, log-probs from
  the gathered full-vocabulary logits one sequence at a time - no code of this package involved,
  the reference ``verify`` checks against.

Weights are seeded by global parameter name, so every tensor-, pipeline- and expert-parallel
layout of a preset holds the same model. Call these inside a rank set up by
:mod:`prefix_sharing.engines.launch`.

The harness is this module; the models are built in :mod:`.megatron_models`, the stock
references and megatron's gaps live in :mod:`.megatron_references`, each layout's way through a
pass in :mod:`.megatron_layouts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..config import PrefixSharingConfig
from ..equivalence import (
    QUANTITIES,
    Comparison,
    RunOutputs,
    advantages,
    at_least_fp32,
    compare_pairs,
    pg_loss,
    same_keys,
)
from ..planner import PromptGroup
from ..refusals import refuse
from .megatron_layouts import LAYOUTS as _STRATEGIES
from .megatron_layouts import layout_for
from .megatron_models import (gpt_model, hybrid_model, model_chunks, preset_model,
                              transformer_config)
from .megatron_references import padded_batch, stock_thd_batch, stock_thd_token_stats
from .megatron_weights import full_grads, seed_weights

__all__ = [
    "LAYOUTS",
    "stock_thd_batch",
    "padded_batch",
    "stock_thd_token_stats",
    "gpt_model",
    "hybrid_model",
    "model_chunks",
    "preset_model",
    "transformer_config",
    "seed_weights",
    "full_grads",
    "MicroBatchRun",
    "chunk_iterators",
    "forward_backward",
    "compare",
    "finalize_sequence_parallel_grads",
    "finalize_context_parallel_grads",
]

LAYOUTS = tuple(_STRATEGIES)


@dataclasses.dataclass
class MicroBatchRun:
    """One pass over the micro-batches: per micro-batch packed outputs (last stage only) and
    this stage's gradients (finalized as for the optimizer step, then :func:`full_grads`);
    ``digests`` are the plans' fingerprints (``shared`` only)."""

    outputs: list[RunOutputs]
    grads: dict[str, torch.Tensor]
    digests: list[str]


def forward_backward(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    batches: Sequence[Sequence[torch.Tensor]],
    layout: str,
    config: PrefixSharingConfig = PrefixSharingConfig(),
    groups: Sequence[Sequence[PromptGroup] | None] | None = None,
    routes: Sequence[Sequence[torch.Tensor]] | None = None,
) -> MicroBatchRun:
    """Forward+backward of every micro-batch through megatron's schedule (see the module doc).

    ``model``: this rank's stage, or its model chunks (:func:`.megatron_models.model_chunks`)
    for megatron's interleaved schedule. That schedule runs each chunk's forward of micro-batch
    ``i`` at its own time (chunk 0 of micro-batches 0..PP-1, then chunk 1 of the same, ...), so
    every chunk reads its own iterator of ``(i, inputs)`` pairs: what a forward uses of
    micro-batch ``i`` (its plan, sequences, routes, loss weights) is looked up by ``i``, never
    taken as "the next one".

    The loss of a micro-batch is :func:`pg_loss` of its log-probs and entropy with seeded
    per-token :func:`advantages`, so every quantity the comparison reads gets a gradient.

    ``routes``: per micro-batch, the recorded MoE routes to replay (one ``[L_i, moe_layers,
    topk]`` tensor per sequence; the model built with ``moe_enable_routing_replay=True``).
    ``"shared"`` hands them to the plan; ``"padded"`` sets each stock router's replay targets
    to them, laid out as its top-k sees the padded ``[s, b]`` batch (this rank's
    sequence-parallel slice of ``s``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    _check_context_parallel_layout(layout)
    chunks = list(model) if isinstance(model, Sequence) else [model]
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    groups = list(groups) if groups is not None else [None] * len(batches)
    strategy = layout_for(layout, config, groups, routes)
    inputs = strategy.prepare(chunks, batches, device)
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    outputs: dict[int, RunOutputs] = {}

    def forward_step(data_iterator, model):
        i, mb = next(data_iterator)
        seqs = batches[i]
        output = strategy.forward(model, mb, i)

        def loss_func(logits):
            packed, log_probs, entropy = strategy.read(logits, seqs, mb)
            weights = advantages(log_probs.numel(), seed=i).to(log_probs.device)
            loss = pg_loss(log_probs, entropy, weights)
            outputs[i] = RunOutputs(at_least_fp32(packed.detach()).cpu(), log_probs.detach().cpu(),
                                    entropy.detach().cpu(), loss.detach().clone().cpu(), {})
            return loss, {}

        return output, loss_func

    iterators = chunk_iterators(inputs, len(chunks))
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=len(inputs),
        seq_length=max(len(s) for b in batches for s in b), micro_batch_size=1,
    )
    digests = strategy.finish(chunks, inputs)
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        finalize_sequence_parallel_grads(chunk)  # the parameters' .grad are then the optimizer's
        finalize_context_parallel_grads(chunk)
        grads.update(full_grads(chunk))
    return MicroBatchRun([outputs[i] for i in sorted(outputs)], grads, digests)


def chunk_iterators(inputs: Sequence[Any], chunks: int) -> list[Iterator[tuple[int, Any]]]:
    """One iterator of ``(micro-batch index, inputs)`` per model chunk: megatron's interleaved
    schedule draws each chunk's micro-batches from that chunk's own iterator, in micro-batch
    order but at the chunk's own times (one iterator shared by the chunks would hand chunk 1 a
    later micro-batch's plan than the activations it receives)."""
    return [iter(list(enumerate(inputs))) for _ in range(chunks)]


def compare(candidate: MicroBatchRun, reference: MicroBatchRun) -> Comparison:
    """Largest differences over all micro-batches (outputs) and this stage's gradients.

    Raises (AssertionError) when the runs differ in what they hold - the number of micro-batch
    outputs, parameter names, any shape - or hold nothing: a run that lost a micro-batch's
    outputs must not compare as equal. (An inner pipeline stage holds no outputs in either run;
    its gradients are compared.)
    """
    if len(candidate.outputs) != len(reference.outputs):
        raise AssertionError(f"the runs hold outputs of {len(candidate.outputs)} vs "
                             f"{len(reference.outputs)} micro-batches")
    same_keys(candidate.grads, reference.grads, "gradients")
    pairs = {q: [(getattr(c, q), getattr(r, q)) for c, r in zip(candidate.outputs, reference.outputs)]
             for q in QUANTITIES if q != "grads"}
    pairs["grads"] = [(candidate.grads[k], g) for k, g in reference.grads.items()]
    return compare_pairs(pairs)


def finalize_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sums, in place, the per-rank partial gradients of sequence-parallel parameters (norms,
    the MoE router: each rank saw only its slice of the tokens) over the tensor-parallel group,
    as megatron's ``finalize_model_grads`` does before the optimizer step. Collective."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=group)


def finalize_context_parallel_grads(model: torch.nn.Module) -> None:
    """Averages, in place, every gradient over the context-parallel group, as megatron's
    ``finalize_model_grads`` does (its data-parallel reduction spans data x context parallel).
    Each CP rank back-propagated its own rows' share of a loss that megatron's schedule scaled
    by the CP size, so the average is the whole micro-batch's gradient. Collective."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return
    group = parallel_state.get_context_parallel_group()
    for param in model.parameters():
        if param.grad is not None:
            torch.distributed.all_reduce(param.grad, group=group)
            param.grad.div_(cp_size)


def _check_context_parallel_layout(layout: str) -> None:
    """Only the shared layout splits a micro-batch across context-parallel ranks (megatron's
    stock attention refuses CP, and its THD layout would need its own zigzag split)."""
    from megatron.core import parallel_state

    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size > 1 and layout != "shared":
        from ..megatron_ext import UnsupportedSetupError

        raise refuse("cli.reference_context_parallel",
                     f"the {layout!r} layout at context_parallel_size={cp_size}",
                     error=UnsupportedSetupError)
