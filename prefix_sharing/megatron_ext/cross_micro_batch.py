"""Forward+backward of one group over several micro-batches, each shared prefix computed once.

For a :class:`~prefix_sharing.group_schedule.GroupSchedule` (shared blocks - the chunks of
the group's common prefix and of its sub-trees' shared parts - and suffix micro-batches, each
of at most the token budget), the schedule's steps run in order, each a micro-batch of
megatron's own schedule (``get_forward_backward_func()``: no pipelining at PP=1, 1F1B under
pipeline parallelism, the interleaved schedule under virtual stages), through the one executor
of :mod:`.cross_steps` (which verl's engine uses too):

1. a block's forward: each layer's core attention reads the K/V of the blocks it reads in
   place and records its own, kept as leaves (:class:`~prefix_sharing.prefix_kv.PrefixKV`, one
   per block, stacked by :class:`~prefix_sharing.prefix_kv.PrefixKVStack`), and its members'
   log-probs and entropy at its positions, kept as leaves too; at PP=1 its graph is kept to
   its backward step (unless ``recompute_prefix``), under pipeline parallelism it runs without
   grad;
2. a suffix micro-batch's forward and backward: its core attention reads its stack's leaves,
   and its loss scores its samples' tails and, from the blocks' leaves, their positions in
   the blocks; so its backward accumulates into every leaf it read (and parameter gradients
   into ``.grad`` as usual);
3. a block's backward step, after its last reader: every leaf's accumulated gradient enters
   the tensor it was detached from (through the kept graph, or the block's forward again with
   grad, its rows reading their recorded K/V with the gradients injected). Since it read the
   blocks below it as leaves, its backward accumulates into their leaves in turn, and theirs
   run after it.

All before the optimizer step and any data-parallel gradient reduction, which see the
parameter gradients of the whole group. Held across the group: the live blocks' K/V leaves and
their gradients (``2 x 2 x layers x held rows x K/V heads x head dim`` values, ``held rows`` the
deepest stack: ``GroupSchedule.held_rows``), plus, with a kept graph, the live blocks' saved
activations.

The loss must be a sum of per-token terms (as token-mean losses over a global batch are):
``token_loss(log_probs, entropy, positions)`` scores the tokens at ``positions`` of the group's
packed order and is called twice per suffix micro-batch (its blocks' positions, its tails');
the group's loss is the sum of its calls.

MoE routers with batch statistics (aux / seq-aux / global-aux losses, z-loss, expert-bias
counts, the logged losses) count each suffix micro-batch as the plain micro-batch of its samples,
prefix included: what megatron's stock step computes when it runs the same samples in the same
micro-batches (each forward's statistics are its own micro-batch's). Every block's router
logits are kept beside its K/V and read by every suffix's plain view, so the prefix tokens count
once per sample holding them and their aux-loss gradients reach the blocks' routers with the
blocks' backwards (see :mod:`.moe`); a block routes per token and keeps no statistic.
``aux_loss_scale`` is the weight megatron's schedule gives each micro-batch's router losses
(``1 / num_microbatches``).

Tensor parallelism (each rank keeps its own K/V heads' prefix; log-probs through the
vocab-parallel reductions), with or without sequence parallelism: the all-gather before the QKV
projection hands core attention every row of the micro-batch, so the K/V leaves are the same as
without it; each micro-batch's rows are padded to a multiple of the tensor-parallel size (the
schedule planned with ``pad_to_multiple_of``) and a block's pad rows are not kept. Dense and MoE
models (router statistics under sequence parallelism too: each rank routes its slice of every
suffix's plain view, the prefix's logits kept whole). Activation recompute (full or selective):
a recomputed layer replays its first run's mode
(:class:`~prefix_sharing.prefix_kv.PrefixKVPass`). Routing replay: a schedule planned with
routes (cut on tokens and routes) has each block replay its rows' routes and each suffix its
flat rows'; a suffix's plain view for the router statistics replays its stack's routes
(:attr:`~prefix_sharing.prefix_kv.PrefixKV.routes`) before its own. Sliding windows (a suffix's
gather of the prefix rows trimmed to the window, as any plan's). Context parallelism, with or
without activation recompute and TP: each micro-batch split over the CP ranks, a block's K/V and
router logits recorded gathered (:mod:`.cross_context_parallel`); a suffix's router statistics
split over the CP ranks as megatron splits its plain micro-batch's (:mod:`.moe`). Pipeline
parallelism, interleaved stages included (each model chunk on its own layers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..cross_micro_batch import GroupSchedule
from .cross_run import (Collector, GroupRun, PrefixPass, TokenLoss, score_suffix,
                        sequence_parallel_size, suffix_routes)
from .cross_steps import GroupSteps, Statistics, fit_interleaved, within_the_step

__all__ = ["GroupRun", "PrefixPass", "TokenLoss", "forward_backward_group"]


def forward_backward_group(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    schedule: GroupSchedule,
    token_loss: TokenLoss,
    *,
    recompute_prefix: bool = False,
    backend: str = "auto",
    temperature: float = 1.0,
    keep_logits: bool = False,
    aux_loss_scale: float = 1.0,
) -> GroupRun:
    """Runs one group's micro-batches (see the module doc); parameter gradients accumulate
    into ``.grad`` (call ``model.zero_grad()`` first when starting a step). Under context
    parallelism each rank's ``.grad`` is CP x its rows' share, as megatron's schedule leaves
    it: average over the data x context group (megatron's DDP) before the step.

    Args:
        model: a ``GPTModel`` built with the prefix-sharing layer spec: the whole model, this
            rank's pipeline stage, or under interleaved pipeline stages its model chunks.
        schedule: the group, from :func:`prefix_sharing.cross_micro_batch.plan_group`.
        token_loss: ``(log_probs, entropy, positions) -> scalar`` for a micro-batch's tokens.
        recompute_prefix: run each block's forward without grad first and again with grad
            at its backward (holds only K/V leaves across the group, computes blocks twice).
        backend: attention kernel, as :class:`~.packed_seq.PlanPackedSeqParams` takes it.
        temperature: logits are divided by it before log-probs and entropy.
        keep_logits: also return every token's logits (for comparisons; ``T_total x V``).
        aux_loss_scale: the gradient weight of each suffix micro-batch's MoE router losses
            (megatron's schedule sets ``1 / num_microbatches`` of the step, 1 with
            ``calculate_per_token_loss``); set on megatron's ``MoEAuxLossAutoScaler`` for
            the group's backwards, times the CP size under context parallelism, as megatron's
            schedule scales them and each micro-batch's loss there.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = list(model) if isinstance(model, Sequence) else [model]
    multiple = sequence_parallel_size(chunks[0])
    plans = [("block", b.plan) for b in schedule.blocks] + [
        ("suffix micro-batch", s.plan) for s in schedule.suffixes]
    unpadded = [kind for kind, plan in plans if plan.input_ids.numel() % multiple]
    if unpadded:
        raise ValueError(
            f"a {unpadded[0]}'s rows do not split over the {multiple} "
            f"sequence-parallel ranks: plan the group with pad_to_multiple_of={multiple}")
    pipelined = get_attr_wrapped_model(chunks[0], "config").pipeline_model_parallel_size > 1
    if len(chunks) > 1 and not pipelined:
        raise ValueError(f"{len(chunks)} model chunks without pipeline parallelism")
    device = next(chunks[0].parameters()).device
    out = Collector(schedule.num_tokens_total, device, keep_logits)

    def read_out(prefix: PrefixPass, logits: torch.Tensor) -> Statistics:
        log_probs, entropy, block_logits = prefix.stats_of(logits)
        out.add_logits(prefix.positions, block_logits)
        shape = (prefix.num_sequences, prefix.prefix_len)
        return log_probs.view(shape), entropy.view(shape)

    # under pipeline parallelism a block's forward is always run again (nothing is sent
    # between stages for a graph kept across micro-batches)
    steps = GroupSteps(schedule, chunks, read_out,
                       keep_graph=not (recompute_prefix or pipelined), training=True,
                       backend=backend, temperature=temperature, device=device)
    items = fit_interleaved(steps.steps, chunks, lambda item: item[0] == "forward")

    def scaled(loss: torch.Tensor) -> torch.Tensor:
        # megatron's schedule divides each micro-batch's loss by their count (and multiplies
        # it by the CP size), then scales it by the factor (within_the_step)
        return loss * len(items) / factor

    def forward_step(data_iterator, chunk):
        c, (kind, i) = next(data_iterator)
        if kind != "suffix":
            return steps.block_step(c, chunk, kind, i, len(items))
        suffix = schedule.suffixes[i]
        output, cp = steps.suffix_forward(c, chunk, i, suffix_routes(suffix, device))

        def loss_func(output: torch.Tensor):
            loss = score_suffix(output[0], suffix, token_loss, out, temperature, cp)
            if suffix.reads:  # every sample's outputs at its blocks' positions
                log_probs, entropy = steps.heads(c, i, list(suffix.members))
                positions = head_positions(schedule, i).to(device)
                head_loss = token_loss(log_probs.flatten(), entropy.flatten(), positions)
                out.add(positions, log_probs.flatten(), entropy.flatten(), head_loss)
                loss = loss + head_loss
            return scaled(loss), {}

        return output, loss_func

    # every chunk reads its own iterator (megatron's interleaved schedule runs each chunk's
    # forward of a micro-batch at its own time)
    iterators = [iter([(c, item) for item in items]) for c in range(len(chunks))]
    with within_the_step(chunks[0], len(items) * aux_loss_scale, accumulate=True) as factor:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks,
            num_microbatches=len(items), seq_length=steps.seq_length, micro_batch_size=1)
    metrics = schedule.metrics()
    metrics["prefix_sharing/cross_recomputed_tokens"] = float(schedule.recomputed_tokens()
                                                              + steps.recomputed_tokens)
    metrics["prefix_sharing/cross_held_bytes"] = float(steps.held_bytes)
    return out.result(steps.held_bytes, schedule.tokens_computed + steps.recomputed_tokens,
                      metrics)


def head_positions(schedule: GroupSchedule, index: int) -> torch.Tensor:
    """The group's packed positions of suffix ``index``'s samples at their blocks' positions,
    in :meth:`~.cross_steps.GroupSteps.heads`' order (sample-major, flattened)."""
    suffix = schedule.suffixes[index]
    parts = []
    for r in suffix.reads:
        block = schedule.blocks[r]
        rows = [block.members.index(m) for m in suffix.members]
        parts.append(block.positions.view(len(block.members), block.length)[rows])
    return torch.cat(parts, dim=1).flatten()
