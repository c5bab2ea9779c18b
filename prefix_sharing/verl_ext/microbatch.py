"""verl's dynamic-batch-size split, replaced by one that keeps sharing groups together.

verl's engines split a batch with ``verl.workers.engine.utils.prepare_micro_batches``, which
calls ``rearrange_micro_batches`` (``verl/utils/seqlen_balancing.py``): it balances by total
tokens and interleaves, so GRPO groups and tree branches land in different micro-batches and
their prefixes are computed again. :func:`patch_prepare_micro_batches` swaps that name in
``verl.workers.engine.utils`` for :func:`rearrange_micro_batches` below, which splits with
:func:`prefix_sharing.batching.split_micro_batches` - while an engine's step runs inside
:func:`sharing_split` with sharing on. Outside it (the feature off, another engine, the
reference model without an overlay) verl's own function runs, unchanged.

verl's contract is kept (0.8.0 and 0.9.1 alike): ``max_token_len`` is the budget (here of the
tokens a micro-batch computes), the micro-batch count is at least ``min_num_micro_batch``, the
same on every data-parallel rank (all-reduced MAX over ``dp_group``) and a multiple of
``num_batches_divided_by``; the result is ``(micro_batches, index lists)``, which verl's
``restore_dynamic_batch`` turns back into the batch order; with ``use_dynamic_bsz_balance``
the lighter micro-batches go to both ends, as verl orders them; a sequence longer than the
budget is refused, as verl refuses it. Samples group by ``uid`` when the batch carries it, else
by the prefixes the planner finds.

Without dynamic batch size (``use_dynamic_bsz: false``, verl's default) verl cuts the batch
into contiguous chunks of ``micro_batch_size_per_gpu`` samples, which cuts GRPO groups that
straddle a chunk boundary. :func:`fixed_order` gives the order to put the batch in so that
those chunks are :func:`prefix_sharing.batching.split_fixed_micro_batches`' micro-batches (as
many samples each, groups whole where an order allows); the engine reorders the batch with
:func:`select_samples` before verl's step and puts the outputs back with
:func:`restore_sample_order`. That changes nothing only where verl's loss is a sum of
per-sample terms over global figures (:func:`loss_order_problem`); elsewhere verl's order is
kept and its cuts are counted. The same holds with dynamic batch size: where the loss or the
model's statistics (a MoE router's auxiliary loss) depend on its micro-batches, verl's own split
runs (:func:`dynamic_split_problem`), each micro-batch shared within.

With ``cross_micro_batch`` on, a group too large for the budget is not cut: it runs as
consecutive micro-batches over one prefix computation (:mod:`.cross_groups`), placed after the
ordinary micro-batches, in order, each tagged (non-tensor key :data:`PART_KEY`) with its place in
the group, which :meth:`SplitRecord.part` gives back to the engine's ``forward_step``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from ..batching import MicroBatchSplit, split_fixed_micro_batches, split_micro_batches
from ..config import PrefixSharingConfig
from ..refusals import refuse
from .cross_groups import CrossPart, plan_cross_groups
from .mcore import PrefixSharingSetupError, prompt_lengths
from .routing_replay import split_routes

__all__ = ["SplitRecord", "sharing_split", "active_split", "rearrange_micro_batches",
           "patch_prepare_micro_batches", "add_split_metrics", "fixed_order", "select_samples",
           "restore_sample_order", "loss_order_problem", "dynamic_split_problem",
           "METRIC_PREFIX", "PART_KEY", "SAMPLEWISE_POLICY_LOSSES"]

logger = logging.getLogger(__name__)

METRIC_PREFIX = "prefix_sharing/"
# Non-tensor key of a micro-batch that belongs to a cross-micro-batch group: its index in
# SplitRecord.parts.
PART_KEY = "prefix_sharing_cross_part"
# verl's policy losses (policy_loss.loss_mode) that are sums of per-token or per-sequence
# terms through agg_loss with the global batch figures: a micro-batch's share of the step's
# loss does not depend on which samples share it. (geo_mean averages over its micro-batch,
# clip_cov / kl_cov pick tokens within it.)
SAMPLEWISE_POLICY_LOSSES = frozenset(
    {"vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "dro", "cispo"})


@dataclasses.dataclass
class SplitRecord:
    """What one engine step's split did; filled by :func:`rearrange_micro_batches`."""

    config: PrefixSharingConfig
    split: MicroBatchSplit | None = None
    parts: list[CrossPart] = dataclasses.field(default_factory=list)
    replay_mode: str = "disabled"  # verl's router_replay.mode: cross groups plan with routes
    # what a cross group's plans are padded to (the engine's; None: megatron's, _row_multiple)
    row_multiple: int | None = None
    # whether the engine keeps a one-level group's prefix graph (else every group nests)
    keep_prefix: bool = True
    # why verl's own dynamic-bsz split runs (the step's loss depends on its micro-batches:
    # :func:`dynamic_split_problem`), None to keep the groups together
    verl_split_reason: str | None = None

    def metrics(self) -> dict[str, float]:
        if self.split is None:
            return {}
        metrics = self.split.metrics(METRIC_PREFIX)
        if self.config.cross_micro_batch:
            groups = {id(p.group): p.group for p in self.parts}.values()
            metrics[f"{METRIC_PREFIX}prefix_recomputes_avoided"] = float(
                sum(g.schedule.prefix_recomputes_avoided for g in groups))
            metrics[f"{METRIC_PREFIX}prefix_kv_held_bytes"] = float(
                max((g.held_bytes for g in groups), default=0))
            metrics[f"{METRIC_PREFIX}cross_held_bytes"] = metrics[
                f"{METRIC_PREFIX}prefix_kv_held_bytes"]
            metrics[f"{METRIC_PREFIX}cross_recomputed_tokens"] = float(
                sum(g.schedule.recomputed_tokens() + g.recomputed_tokens for g in groups))
        return metrics

    def part(self, micro_batch: Any) -> CrossPart | None:
        """The cross-group micro-batch ``micro_batch`` is, or ``None`` for an ordinary one."""
        from verl.utils import tensordict_utils as tu

        index = tu.get_non_tensor_data(micro_batch, key=PART_KEY, default=None)
        return None if index is None else self.parts[index]


_ACTIVE: contextvars.ContextVar[SplitRecord | None] = contextvars.ContextVar(
    "prefix_sharing_split", default=None)


@contextlib.contextmanager
def sharing_split(config: PrefixSharingConfig, replay_mode: str = "disabled",
                  row_multiple: int | None = None,
                  keep_prefix: bool = True) -> Iterator[SplitRecord]:
    """Within this block, verl's dynamic-bsz split keeps ``config``'s sharing groups together.

    An engine wraps its ``forward_backward_batch`` in it; the yielded record holds the split
    afterwards (for :func:`add_split_metrics`). With ``mode="off"`` verl's split runs as is.
    ``replay_mode``: verl's ``router_replay.mode`` (groups across micro-batches are cut on
    tokens and routes: :func:`.routing_replay.split_routes`). ``row_multiple``: what a cross
    group's plans are padded to (the FSDP engine's Ulysses size; by default megatron's
    tensor- times context-parallel size). ``keep_prefix``: whether the engine keeps a one-level
    group's prefix graph between its forward and backward steps (else every cross group
    nests: :func:`.cross_groups.plan_cross_groups`).
    """
    record = SplitRecord(config, replay_mode=replay_mode, row_multiple=row_multiple,
                         keep_prefix=keep_prefix)
    token = _ACTIVE.set(record if config.enabled else None)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def active_split() -> SplitRecord | None:
    """The record of the sharing split in effect (``None`` outside :func:`sharing_split`)."""
    return _ACTIVE.get()


def add_split_metrics(output: dict, record: SplitRecord) -> None:
    """Adds the split's figures to an engine output's ``metrics``, without replacing a figure
    the engine measured itself. One value per step, as a one-element list like verl's
    per-micro-batch metrics: the worker all-gathers each metric over DP ranks and then
    flattens the lists (a bare number there would fail)."""
    metrics = output.setdefault("metrics", {})
    for key, value in record.metrics().items():
        metrics.setdefault(key, [value])


def rearrange_micro_batches(
    stock: Callable[..., Any],
    batch: Any,
    max_token_len: int,
    dp_group: Any = None,
    num_batches_divided_by: int | None = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: int | None = None,
    use_dynamic_bsz_balance: bool = True,
    force_group_size: int = 1,
    **kwargs: Any,
) -> tuple[list, list[list[int]]]:
    """verl's ``rearrange_micro_batches`` with sharing groups kept together (see module doc).

    ``stock`` is verl's own function: it runs when no :func:`sharing_split` is active, when
    ``force_group_size > 1`` (verl's fixed blocks, used for reward-model pairs, which the
    sharing split does not know about) and when the step's loss depends on its micro-batches
    (``record.verl_split_reason``: :func:`dynamic_split_problem`).
    """
    record = _ACTIVE.get()
    if record is None or force_group_size > 1 or record.verl_split_reason is not None:
        return stock(batch, max_token_len, dp_group=dp_group,
                     num_batches_divided_by=num_batches_divided_by,
                     same_micro_num_in_dp=same_micro_num_in_dp,
                     min_num_micro_batch=min_num_micro_batch,
                     use_dynamic_bsz_balance=use_dynamic_bsz_balance,
                     force_group_size=force_group_size, **kwargs)
    from verl.utils import tensordict_utils as tu

    sequences, uids, prompt_lens = _samples(batch, record.config, tu)
    routes, may_cross = split_routes(batch, record.replay_mode)
    cross, rest = [], list(range(len(sequences)))
    if may_cross:
        cross, rest = plan_cross_groups(sequences, max_token_len, record.config, uids,
                                        record.row_multiple or _row_multiple(), routes=routes,
                                        nested=True, keep_prefix=record.keep_prefix)
    parts = [part for group in cross for part in group.parts()]
    result = _split_ordinary(sequences, rest, max_token_len, record.config, uids, prompt_lens,
                             max(1, (min_num_micro_batch or 1) - len(parts)))
    count = _agreed_count(len(result.micro_batches) + len(parts), dp_group, same_micro_num_in_dp,
                          num_batches_divided_by, len(sequences))
    if count > len(result.micro_batches) + len(parts):
        wanted = count - len(parts)
        if wanted > len(rest):
            raise ValueError(
                f"{count} micro-batches are needed (data-parallel agreement / virtual pipeline "
                f"multiple), but this rank's cross-micro-batch groups take {len(parts)} and only "
                f"{len(rest)} other samples are left to fill the rest; turn "
                "prefix_grouper.cross_micro_batch off or balance the batch")
        result = _split_ordinary(sequences, rest, max_token_len, record.config, uids,
                                 prompt_lens, wanted)
    record.split = _with_parts(result, parts, len(cross))
    record.parts = parts

    order = list(range(len(result.micro_batches)))
    if use_dynamic_bsz_balance:  # verl's order: heaviest in the middle, lighter at both ends
        order.sort(key=lambda m: (result.tokens_computed[m], result.micro_batches[m][0]), reverse=True)
        order = order[::2][::-1] + order[1::2]
    index_lists = [list(result.micro_batches[m]) for m in order]
    micro_batches = [tu.index_select_tensor_dict(batch, idx) for idx in index_lists]
    for k, part in enumerate(parts):  # each group's micro-batches consecutive, in run order
        index_lists.append(part.batch_indices)
        micro_batches.append(tu.index_select_tensor_dict(batch, part.batch_indices))
        tu.assign_non_tensor(micro_batches[-1], **{PART_KEY: k})
    return micro_batches, index_lists


def _row_multiple() -> int:
    """What a cross group's micro-batches are padded to, as the shared forward pads its plans:
    megatron's tensor- times context-parallel size (context parallelism splits the rows over
    its ranks, sequence parallelism each slice over TP; 1 without megatron's parallel state)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return 1
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return (parallel_state.get_tensor_model_parallel_world_size()
            * parallel_state.get_context_parallel_world_size())


def _split_ordinary(sequences: list, rest: list[int], max_token_len: int,
                    config: PrefixSharingConfig, uids: list | None, prompt_lens: list | None,
                    minimum: int) -> MicroBatchSplit:
    """:func:`split_micro_batches` of the samples ``rest`` (indices into the batch, ascending),
    its micro-batches given in batch indices; no micro-batch when ``rest`` is empty."""
    if not rest:
        return MicroBatchSplit((), (), (), max_token_len, 0, 0, ())

    def pick(values: list | None) -> list | None:
        return None if values is None else [values[i] for i in rest]

    result = split_micro_batches(pick(sequences), max_token_len, config, uids=pick(uids),
                                 prompt_lens=pick(prompt_lens), min_micro_batches=minimum)
    if result.oversized:  # as verl's own split refuses it: one sequence alone breaks the budget
        longest = max(len(sequences[rest[i]]) for i in result.oversized)
        raise ValueError(f"max_token_len ({max_token_len}) must be at least the longest sequence "
                         f"({longest} tokens): raise max_token_len_per_gpu")
    return dataclasses.replace(
        result, micro_batches=tuple(tuple(rest[i] for i in mb) for mb in result.micro_batches))


def _with_parts(result: MicroBatchSplit, parts: list[CrossPart],
                num_cross_groups: int) -> MicroBatchSplit:
    """The step's whole split, for its figures: the ordinary micro-batches, then the cross
    groups' (each cross group counts as one group, not split: its prefix is computed once)."""
    return dataclasses.replace(
        result,
        micro_batches=result.micro_batches + tuple(tuple(p.batch_indices) for p in parts),
        tokens_total=result.tokens_total + tuple(p.tokens_total for p in parts),
        tokens_computed=result.tokens_computed + tuple(p.tokens_computed for p in parts),
        num_groups=result.num_groups + num_cross_groups,
    )


def _samples(batch: Any, config: PrefixSharingConfig, tu: ModuleType) -> tuple[list, list | None,
                                                                                  list | None]:
    """Per-sample token ids (on the host: one device-to-host copy for the batch, as the split
    plans many subsets), uids (when the batch has them) and prompt lengths (prompt_only)."""
    input_ids = batch["input_ids"]
    if input_ids.is_nested:
        lengths = input_ids.offsets().diff().tolist()
        sequences = list(input_ids.values().cpu().split(lengths))
    else:
        mask = batch["attention_mask"].bool().cpu()
        sequences = [row[m] for row, m in zip(input_ids.cpu(), mask)]
    uids = tu.get(batch, "uid", default=None)
    prompt_lens = None
    if config.mode == "prompt_only":
        if uids is None:
            raise refuse("verl.prompt_uids", "prefix_grouper.mode=prompt_only, but the batch "
                         "has no 'uid' field (an SFT batch has none)",
                         error=PrefixSharingSetupError)
        prompt_lens = prompt_lengths(batch)
    return sequences, uids, prompt_lens


def _agreed_count(count: int, dp_group: Any, same_micro_num_in_dp: bool,
                  num_batches_divided_by: int | None, num_samples: int) -> int:
    """The micro-batch count verl's contract asks for: the max over DP ranks, rounded up to a
    multiple of the virtual-pipeline group size."""
    if same_micro_num_in_dp and dp_group is not None and torch.distributed.is_initialized():
        from verl.utils.device import get_device_name

        agreed = torch.tensor([count], device=get_device_name())
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        count = int(agreed.item())
    if num_batches_divided_by:
        count = -(-count // num_batches_divided_by) * num_batches_divided_by
    if count > num_samples:
        raise ValueError(f"{count} micro-batches are needed (data-parallel agreement / virtual "
                         f"pipeline multiple) but this rank holds only {num_samples} samples")
    return count


def patch_prepare_micro_batches(engine_utils: ModuleType) -> None:
    """Points ``verl.workers.engine.utils.rearrange_micro_batches`` (the name its
    ``prepare_micro_batches`` calls) at :func:`rearrange_micro_batches`. Idempotent."""
    current = engine_utils.rearrange_micro_batches
    if getattr(current, "_prefix_sharing_stock", None) is not None:
        return
    patched = functools.wraps(current)(functools.partial(rearrange_micro_batches, current))
    patched._prefix_sharing_stock = current
    engine_utils.rearrange_micro_batches = patched


def fixed_order(data: Any, record: SplitRecord | None, loss_function: Any, forward_only: bool,
                model_problem: str | None = None) -> list[int] | None:
    """The sample order that makes verl's fixed micro-batches keep sharing groups whole, or
    ``None`` to keep verl's order (see the module doc).

    Applies without dynamic batch size and ``force_group_size`` 1, inside
    :func:`sharing_split` (``record``, which receives the split's figures either way). The
    order is taken when the packing improves on verl's chunks
    (:func:`~prefix_sharing.batching.split_fixed_micro_batches`) and the step's results
    cannot depend on which samples share a micro-batch: a forward-only step, or a loss that
    :func:`loss_order_problem` accepts on a model without per-micro-batch statistics
    (``model_problem``: the engine's reason, e.g. a router's auxiliary loss).
    """
    from verl.utils import tensordict_utils as tu

    size = tu.get_non_tensor_data(data, key="micro_batch_size_per_gpu", default=None)
    if (record is None or size is None
            or tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True)
            or tu.get_non_tensor_data(data, key="force_group_size", default=1) > 1
            or len(data) % size):  # verl refuses the last itself
        return None
    sequences, uids, prompt_lens = _samples(data, record.config, tu)
    problem = None if forward_only else model_problem or loss_order_problem(loss_function, data)
    record.split = split_fixed_micro_batches(sequences, size, record.config, uids=uids,
                                             prompt_lens=prompt_lens,
                                             reorder=problem is None)
    if problem is not None:
        _warn_once(f"prefix-sharing: fixed micro-batches keep verl's sample order ({problem}); "
                   "sharing groups cut by them share less"
                   + ("" if model_problem else
                      " (a loss listed in docs/verl.md keeps them whole)"))
    order = record.split.order
    return None if order == sorted(order) else order


def dynamic_split_problem(data: Any, record: SplitRecord, loss_function: Any,
                          forward_only: bool, model_problem: str | None = None) -> str | None:
    """Why verl's own dynamic-bsz split must run for this step, or ``None``: a training step
    whose loss depends on which samples share a micro-batch (:func:`loss_order_problem`, e.g.
    ``geo_mean``'s mean over the micro-batch's sequences; or ``model_problem``, the engine's
    reason, e.g. a MoE router's auxiliary loss, taken per micro-batch) gets verl's
    micro-batches, shared within each, so its gradients stay verl's. Sets
    ``record.verl_split_reason`` (warned once)."""
    from verl.utils import tensordict_utils as tu

    if (forward_only or not record.config.enabled
            or not tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=False)):
        return None
    record.verl_split_reason = model_problem or loss_order_problem(loss_function, data)
    if record.verl_split_reason is not None:
        _warn_once(f"prefix-sharing: dynamic bsz keeps verl's micro-batches "
                   f"({record.verl_split_reason}); sharing groups cut by them share less")
    return record.verl_split_reason


def loss_order_problem(loss_function: Any, data: Any) -> str | None:
    """Why the step's loss and gradients could change when samples change micro-batches
    (``None`` when they cannot).

    verl's loss is summed over micro-batches; each micro-batch's term is its samples'
    terms over the step's global figures when the loss is verl's ``sft_loss`` (global token
    count), ``ppo_loss`` with a policy loss in :data:`SAMPLEWISE_POLICY_LOSSES`, or the
    critic's ``value_loss`` where verl normalises it over the global batch (0.9.1: its
    ``compute_value_loss`` takes ``batch_num_tokens``; 0.8.0's averages over the micro-batch),
    each with a ``loss_agg_mode`` whose normaliser is global: ``token-mean`` (the engine sets
    the global ``batch_num_tokens``), ``token-sum``, the ``seq-mean-*`` modes with the
    trainer's ``global_batch_size``, and ``seq-mean-token-sum-norm`` only with a fixed
    ``loss_scale_factor`` or a response mask of one width for the batch (else its horizon
    is the micro-batch's longest response).
    """
    if loss_function is None:
        return None
    func = getattr(loss_function, "func", loss_function)
    name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__name__', func)}"
    config = getattr(loss_function, "keywords", {}).get("config")
    if name == "verl.workers.utils.losses.sft_loss":
        return None
    if name == "verl.workers.utils.losses.value_loss":
        if not _global_value_loss():
            return "this verl's value_loss averages over its micro-batch"
        return _aggregation_problem(config, data)
    if name != "verl.workers.utils.losses.ppo_loss":
        return f"the loss {name} is not known to be a sum over samples"
    policy_loss = getattr(config, "policy_loss", None)
    loss_mode = (policy_loss.get("loss_mode", "vanilla") if hasattr(policy_loss, "get")
                 else getattr(policy_loss, "loss_mode", "vanilla"))
    if loss_mode not in SAMPLEWISE_POLICY_LOSSES:
        return f"policy_loss.loss_mode={loss_mode!r} depends on its micro-batch"
    return _aggregation_problem(config, data)


def _aggregation_problem(config: Any, data: Any) -> str | None:
    """Why ``config``'s ``loss_agg_mode`` normalises a micro-batch's loss by a figure of its
    own (``None`` when the normaliser is global; see :func:`loss_order_problem`)."""
    from verl.utils import tensordict_utils as tu

    agg = config.loss_agg_mode
    if agg.startswith("seq-mean") and tu.get_non_tensor_data(
            data, key="global_batch_size", default=None) is None:
        return f"loss_agg_mode={agg!r} without the trainer's global_batch_size"
    if (agg == "seq-mean-token-sum-norm" and config.loss_scale_factor is None
            and data["response_mask"].is_nested):
        return ("loss_agg_mode='seq-mean-token-sum-norm' normalises by the micro-batch's "
                "longest response unless loss_scale_factor is set")
    return None


def _global_value_loss() -> bool:
    """Whether verl's ``value_loss`` normalises over the global batch (its
    ``compute_value_loss`` takes the global ``batch_num_tokens``)."""
    import inspect

    from verl.trainer.ppo.core_algos import compute_value_loss

    return "batch_num_tokens" in inspect.signature(compute_value_loss).parameters


def select_samples(data: Any, order: list[int]) -> Any:
    """``data`` with its samples in ``order`` (every field, non-tensor ones included)."""
    from verl.utils import tensordict_utils as tu

    return tu.index_select_tensor_dict(data, order)


def restore_sample_order(output: dict, order: list[int]) -> None:
    """Puts each per-sample output of a step run on ``select_samples(data, order)`` back in
    ``data``'s order, in place (verl's ``restore_dynamic_batch``, as verl restores its own
    dynamic split). An inner pipeline stage's empty output is left as it is."""
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    model_output = (output or {}).get("model_output", {})
    for key, value in model_output.items():
        model_output[key] = restore_dynamic_batch(value, [order])


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)
