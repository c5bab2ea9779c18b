"""Forward+backward of one group over several micro-batches, its common prefix computed once.

For a :class:`~prefix_sharing.cross_micro_batch.GroupSchedule` (the group's prefix, then
suffix micro-batches of at most the token budget):

1. the prefix micro-batch runs (with grad, its graph kept; or without grad under
   ``recompute_prefix``); each layer's core attention records its K/V, kept as leaves
   (:class:`~.prefix_kv.PrefixKV`);
2. every suffix micro-batch runs forward and backward; its core attention reads
   ``cat(prefix leaves, own K/V)`` through its plan, so its backward accumulates dK/dV into the
   leaves (and parameter gradients into ``.grad`` as usual);
3. after the last suffix, the prefix's backward runs once, with the accumulated dK/dV as the
   incoming gradients of its recorded K/V, plus the loss of the prefix positions (under
   ``recompute_prefix`` its forward is first run again with grad).

All before the optimizer step and any data-parallel gradient reduction, which see the
parameter gradients of the whole group. One level (one shared prefix per group). Held across
the group: the K/V leaves and their gradients (``2 x 2 x layers x Lp x K/V heads x head dim``
values), plus, without ``recompute_prefix``, the prefix micro-batch's saved activations.

The loss must be a sum of per-token terms (as token-mean losses over a global batch are):
``token_loss(log_probs, entropy, positions)`` scores the tokens at ``positions`` of the group's
packed order and is called once per micro-batch; the group's loss is the sum of its calls.

MoE routers with batch statistics (aux / seq-aux / global-aux losses, z-loss, expert-bias
counts, the logged losses) count each suffix micro-batch as the plain micro-batch of its samples,
prefix included: what megatron's stock step computes when it runs the same samples in the same
micro-batches (each forward's statistics are its own micro-batch's). The prefix's router logits
are kept beside its K/V and read by every suffix's plain view, so the prefix tokens count once
per sample holding them and their aux-loss gradients reach the prefix's router with the
prefix's backward (see :mod:`.moe`). ``aux_loss_scale`` is the weight megatron's schedule gives
each micro-batch's router losses (``1 / num_microbatches``).

PP=1; tensor parallelism (each rank keeps its own K/V heads' prefix; log-probs through the
vocab-parallel reductions), with or without sequence parallelism: the all-gather before the
QKV projection hands core attention every row of the micro-batch, so the prefix K/V leaves are
the same as without it; each micro-batch's rows are padded to a multiple of the
tensor-parallel size (the schedule planned with ``pad_to_multiple_of``, the prefix
micro-batch here) and the prefix's pad rows are not kept. Dense and MoE models (router
statistics under sequence parallelism too: each rank routes its slice of every suffix's plain
view, the prefix's logits kept whole). Activation recompute (full or selective): a recomputed
layer replays its first run's mode (:class:`~.prefix_kv.PrefixKVPass`). Sliding windows (a
suffix's gather of the prefix rows trimmed to the window, as any plan's). Pipeline parallelism
is refused by name (context parallelism by the core attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from megatron.core.utils import get_attr_wrapped_model

from ..config import PrefixSharingConfig
from ..cross_micro_batch import GroupSchedule
from ..logprobs import token_log_probs
from ..planner import build_plan
from ..refusals import Refused, refuse_all
from .checks import UnsupportedSetupError
from .logprobs import vocab_shard
from .packed_seq import PlanPackedSeqParams
from .prefix_kv import PrefixKV

__all__ = ["GroupRun", "PrefixPass", "TokenLoss", "check_group_model", "forward_backward_group"]

TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class GroupRun:
    """What one group's forward+backward produced (all detached).

    Attributes:
        log_probs, entropy: ``(T_total,)`` every token of the group, packed in given order.
        logits: ``(T_total, V)`` the same rows' logits (the whole vocabulary), when asked for
            (``keep_logits``).
        loss: the sum of the micro-batches' losses.
        held_bytes: the prefix K/V leaves and their gradients, held across the group (with
            MoE router statistics, the prefix's router logits and their gradients too).
        tokens_computed: tokens the model ran, over all micro-batches (a recomputed prefix
            counted twice).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor
    logits: torch.Tensor | None
    loss: torch.Tensor
    held_bytes: int
    tokens_computed: int


def forward_backward_group(
    model: torch.nn.Module,
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
    into ``.grad`` (call ``model.zero_grad()`` first when starting a step).

    Args:
        model: a whole (single-stage) ``GPTModel`` built with the prefix-sharing layer spec.
        schedule: the group, from :func:`prefix_sharing.cross_micro_batch.plan_group`.
        token_loss: ``(log_probs, entropy, positions) -> scalar`` for a micro-batch's tokens.
        recompute_prefix: run the prefix's forward without grad first and again with grad at
            the end (holds only the K/V leaves across the group, computes the prefix twice).
        backend: attention kernel, as :class:`~.packed_seq.PlanPackedSeqParams` takes it.
        temperature: logits are divided by it before log-probs and entropy.
        keep_logits: also return every token's logits (for comparisons; ``T_total x V``).
        aux_loss_scale: the gradient weight of each suffix micro-batch's MoE router losses
            (megatron's schedule sets ``1 / num_microbatches`` of the step, 1 with
            ``calculate_per_token_loss``); set on
            megatron's ``MoEAuxLossAutoScaler`` for the group's backwards.
    """
    check_group_model(model)
    device = next(model.parameters()).device
    multiple = _sequence_parallel_size(model)
    unpadded = [i for i, s in enumerate(schedule.suffixes) if s.plan.input_ids.numel() % multiple]
    if unpadded:
        raise ValueError(
            f"suffix micro-batch {unpadded[0]}'s rows do not split over the {multiple} "
            f"sequence-parallel ranks: plan the group with pad_to_multiple_of={multiple}")
    if get_attr_wrapped_model(model, "config").num_moe_experts:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # set_loss_scale copies into the scale it holds: [1] when megatron's schedule made it,
        # [] when the autoscaler's own backward did
        held = MoEAuxLossAutoScaler.main_loss_backward_scale
        MoEAuxLossAutoScaler.set_loss_scale(torch.full(
            (1,) if held is None else held.shape, float(aux_loss_scale), device=device))
    total = schedule.num_tokens_total
    out = _Collector(total, device, keep_logits)
    prefix_kv = PrefixKV(rows=schedule.prefix_len)
    prefix = PrefixPass(schedule, prefix_kv, backend, temperature, device, multiple)
    if recompute_prefix:
        with torch.no_grad():
            prefix.forward(model)
        prefix_loss = None
    else:
        prefix_loss = prefix.scored(model, token_loss, out)
    prefix_kv.mode = "read"
    for suffix in schedule.suffixes:
        plan = suffix.plan.to(device)
        tail_plan = suffix.tail_plan.to(device)
        params = PlanPackedSeqParams.from_plan(plan, backend, prefix_kv=prefix_kv)
        logits = model(plan.input_ids[None], plan.position_ids[None], None,
                       packed_seq_params=params)[0]  # [1, T, V] -> [T, V]
        stats = token_log_probs(logits, tail_plan, temperature=temperature,
                                vocab_shard=vocab_shard(logits.size(-1)))
        positions = suffix.token_positions.to(device)
        loss = token_loss(stats.log_probs, stats.entropy, positions)
        loss.backward()
        out.add(positions, stats.log_probs, stats.entropy, loss,
                lambda: tail_plan.restore(logits))
    prefix_kv.mode = "record"
    if recompute_prefix:
        prefix_loss = prefix.scored(model, token_loss, out)
    held = prefix_kv.held_bytes()
    prefix_kv.backward([prefix_loss])
    computed = schedule.tokens_computed + (schedule.prefix_len if recompute_prefix else 0)
    return out.result(held, computed)


class PrefixPass:
    """The prefix micro-batch: ``P`` alone (identity plan; pad rows after it to a multiple of
    ``pad_to_multiple_of``), recording its K/V."""

    def __init__(self, schedule: GroupSchedule, prefix_kv: PrefixKV, backend: str,
                 temperature: float, device: torch.device, pad_to_multiple_of: int = 1) -> None:
        plan = build_plan([schedule.prefix_ids], PrefixSharingConfig(),
                          pad_to_multiple_of=pad_to_multiple_of).to(device)
        self.prefix_len = schedule.prefix_len
        self.params = PlanPackedSeqParams.from_plan(plan, backend, prefix_kv=prefix_kv)
        self.stats_plan = schedule.prefix_stats_plan.to(device)
        # the prefix rows of every sequence, without the placeholder position Lp
        self.keep = (~schedule.prefix_stats_plan.is_last_token).nonzero()[:, 0].to(device)
        self.positions = schedule.prefix_positions.to(device)
        self.num_sequences = len(schedule.seq_lens)
        self.temperature = temperature

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        plan = self.params.plan
        return model(plan.input_ids[None], plan.position_ids[None], None,
                     packed_seq_params=self.params)[0]  # [Lp (+ pad rows), V]

    def stats(self, model: torch.nn.Module,
              with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None,
                                                  Callable[[], torch.Tensor]]:
        """Forward, then every sequence's log-probs and entropy at positions ``0 .. Lp-1``
        (``(N * Lp,)`` each, sequence-major: ``schedule.prefix_positions``' order), and a
        callable giving those positions' logits."""
        logits = self.forward(model)[: self.prefix_len]  # the pad rows' logits are not read
        # one placeholder row per sequence: the stats plan's position Lp, discarded
        rows = torch.cat([logits, logits.new_zeros(self.num_sequences, logits.size(1))])
        stats = token_log_probs(rows, self.stats_plan, temperature=self.temperature,
                                with_entropy=with_entropy, vocab_shard=vocab_shard(rows.size(-1)))
        log_probs = stats.log_probs.index_select(0, self.keep)
        entropy = stats.entropy.index_select(0, self.keep) if with_entropy else None
        return log_probs, entropy, lambda: self.stats_plan.restore(rows).index_select(0, self.keep)

    def scored(self, model: torch.nn.Module, token_loss: TokenLoss,
               out: _Collector) -> torch.Tensor:
        """Forward with grad, and the loss of every sequence's positions ``0 .. Lp-1``."""
        log_probs, entropy, logits = self.stats(model)
        loss = token_loss(log_probs, entropy, self.positions)
        out.add(self.positions, log_probs, entropy, loss, logits)
        return loss


class _Collector:
    """Assembles the group's per-token outputs from its micro-batches."""

    def __init__(self, total: int, device: torch.device, keep_logits: bool) -> None:
        self.log_probs = torch.zeros(total, device=device)
        self.entropy = torch.zeros(total, device=device)
        self.logits: torch.Tensor | None = None
        self.keep_logits = keep_logits
        self.loss = torch.zeros((), device=device)
        self.total = total

    def add(self, positions: torch.Tensor, log_probs: torch.Tensor, entropy: torch.Tensor,
            loss: torch.Tensor, logits: Callable[[], torch.Tensor]) -> None:
        self.log_probs = self.log_probs.to(log_probs.dtype)
        self.entropy = self.entropy.to(entropy.dtype)
        self.log_probs[positions] = log_probs.detach()
        self.entropy[positions] = entropy.detach()
        self.loss = self.loss + loss.detach()
        if self.keep_logits:
            rows = _whole_vocab(logits().detach())
            if self.logits is None:
                self.logits = rows.new_zeros(self.total, rows.size(1))
            self.logits[positions] = rows

    def result(self, held_bytes: int, tokens_computed: int) -> GroupRun:
        return GroupRun(self.log_probs, self.entropy, self.logits, self.loss, held_bytes,
                        tokens_computed)


def _whole_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Every rank's vocabulary slice side by side (for comparisons; no gradient)."""
    if vocab_shard(logits.size(-1)) is None:
        return logits
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def _sequence_parallel_size(model: torch.nn.Module) -> int:
    """The number of ranks a micro-batch's rows are split over (1 without sequence
    parallelism)."""
    if not get_attr_wrapped_model(model, "config").sequence_parallel:
        return 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def check_group_model(model: torch.nn.Module) -> None:
    """Raises :class:`UnsupportedSetupError` naming every setting a group run cannot honour."""
    config = get_attr_wrapped_model(model, "config")
    found = []
    if config.pipeline_model_parallel_size > 1:
        found.append(Refused("megatron.cross_micro_batch.pipeline",
                             f"pipeline_model_parallel_size={config.pipeline_model_parallel_size}"))
    if found:
        raise refuse_all(found, error=UnsupportedSetupError)
