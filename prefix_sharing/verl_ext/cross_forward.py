"""verl's Megatron forward for one micro-batch of a group that runs across micro-batches.

A :class:`~.cross_groups.CrossGroup` is run as consecutive verl micro-batches, each holding
the samples whose tails it computes. verl's loop (megatron's ``forward_backward_no_pipelining``)
runs forward then backward per micro-batch, so the prefix is woven into them:

- the group's **first** micro-batch runs the prefix first (identity plan, its K/V recorded per
  layer: :class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKV`) and scores every sample's
  prefix positions ``0 .. Lp-1`` (the last prefix row predicts each sample's first own token).
  Those log-probs / entropy and the K/V are kept in the prefix's graph, and as leaves;
- every micro-batch but the last reads the leaves: its attention over ``cat(prefix K/V, own)``
  and its samples' rows ``cat(prefix statistics, own)``, so its backward accumulates the
  prefix's gradients in the leaves' ``.grad`` and stops there;
- the **last** micro-batch reads the recorded tensors themselves (``read_through``: the leaves'
  accumulated gradients are added on the way back), so its backward - megatron's, like every
  other - runs the prefix's backward once, with every micro-batch's gradient, inside the same
  pass. Everything happens before verl's optimizer step and megatron's gradient reduction.

A group that does not fit one level (a prefix over half the budget, a tail over the rest)
nests instead - its prefix in chunks, its branches in sub-tree blocks - where the engine's model
allows it: :mod:`.cross_nested` runs those blocks around the same suffix forward.

Each sample's log-probs and entropy come back as verl expects them (the value at ``t`` scores
token ``t + 1``, the last position 0), so verl's loss runs unchanged on each micro-batch.
Held across the group: the prefix's activations (its graph) and its K/V leaves with their
gradients. Under activation recompute (full or selective) the prefix's recomputed layers keep
only their inputs, and their replay - inside the last micro-batch's backward, in the prefix's
own ``record`` mode (:class:`~prefix_sharing.megatron_ext.prefix_kv.PrefixKVPass`) - injects
every micro-batch's dK/dV, the last one's included, which then reads the leaves too. Under
tensor parallelism each micro-batch's rows, the prefix's included, are padded to the
tensor-parallel size (sequence parallelism splits them over its ranks; the prefix's pad rows are
not kept). Sliding windows run as in the group driver. MoE router statistics are each cross
micro-batch's plain micro-batch's, as in the group driver (at TP=1; under sequence
parallelism they are refused). The model must run with PP=1 (each refusal raises one error
naming the setting).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import PrefixSharingConfig
from ..refusals import Refused, refuse, refuse_all
from .cross_groups import CrossPart
from .mcore import (PrefixSharingSetupError, SharingMetrics, check_text_only,
                    micro_batch_temperature)

__all__ = ["GroupState", "check_cross_engine_setup", "check_cross_model", "cross_forward"]


@dataclasses.dataclass
class GroupState:
    """What a group's first micro-batch leaves for the others.

    Attributes:
        prefix_kv: the prefix's K/V per layer, recorded and as leaves.
        log_probs, entropy: ``(N, Lp)`` every sample's prefix-position statistics, in the
            prefix's graph (``entropy`` ``None`` when not asked for).
        leaves: the same, detached, requiring grad (what all but the last micro-batch read).
        temperature: the group's sampling temperature (all its micro-batches must agree).
    """

    prefix_kv: Any
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    leaves: tuple[torch.Tensor, torch.Tensor | None]
    temperature: float

    def prefix_stats(self, members: list[int],
                     last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(len(members), Lp)`` statistics of these samples' prefix positions: the leaves, or
        the recorded tensors read through for the last micro-batch."""
        from ..megatron_ext.prefix_kv import read_through

        index = torch.tensor(members, device=self.log_probs.device)
        picked = []
        for recorded, leaf in zip((self.log_probs, self.entropy), self.leaves):
            if recorded is None:
                picked.append(None)
                continue
            source = read_through(recorded, leaf) if last else leaf
            picked.append(source.index_select(0, index))
        return picked[0], picked[1]


def cross_forward(
    model,
    input_ids: torch.Tensor,
    multi_modal_inputs: dict,
    logits_processor=None,
    logits_processor_args: dict | None = None,
    value_model: bool = False,
    vision_model: bool = False,
    *,
    part: CrossPart,
    sharing: PrefixSharingConfig,
    calculate_entropy: bool,
    metrics: SharingMetrics | None = None,
    replay_routes: list[torch.Tensor] | None = None,
    **_verl_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """verl's ``gptmodel_forward_model_engine`` for the micro-batch ``part`` of a cross group
    (see the module doc); arguments as :func:`.mcore.shared_forward` takes them."""
    if replay_routes is not None:
        raise refuse("verl.cross_micro_batch.router_replay", "routes came with the micro-batch",
                     error=PrefixSharingSetupError)
    from ..logprobs import token_log_probs
    from ..megatron_ext import check_sharing_model
    from ..megatron_ext.logprobs import vocab_shard
    from ..megatron_ext.packed_seq import PlanPackedSeqParams

    check_text_only(value_model, vision_model, multi_modal_inputs)
    check_sharing_model(model)
    check_cross_model(model)
    suffix = part.group.schedule.suffixes[part.index]
    if input_ids.size(0) != len(suffix.members):
        raise ValueError(f"micro-batch {part.index} of a cross-micro-batch group holds "
                         f"{input_ids.size(0)} samples; its plan has {len(suffix.members)}")
    temperature = micro_batch_temperature((logits_processor_args or {}).get("temperature"))
    device = input_ids.device
    if part.group.nested:  # chunks and sub-tree blocks (.cross_nested)
        from .cross_nested import close_micro_batch, open_micro_batch

        prefix_kv = open_micro_batch(model, part, sharing.backend, temperature,
                                     calculate_entropy, device)
    elif part.first:
        part.group.state = _run_prefix(model, part, sharing, temperature, calculate_entropy,
                                       device)
    state = part.group.state
    if temperature != state.temperature:
        raise refuse("verl.temperatures", f"a cross-micro-batch group with temperatures "
                     f"{state.temperature} and {temperature}", error=PrefixSharingSetupError)
    if not part.group.nested:
        state.prefix_kv.mode = "read_last" if part.last else "read"
        prefix_kv = state.prefix_kv
    plan, tail_plan = suffix.plan.to(device), suffix.tail_plan.to(device)
    params = PlanPackedSeqParams.from_plan(plan, sharing.backend, prefix_kv=prefix_kv)
    logits = model(input_ids=plan.input_ids[None], attention_mask=None,
                   position_ids=plan.position_ids[None], packed_seq_params=params)[0]
    stats = token_log_probs(logits, tail_plan, temperature=temperature,
                            with_entropy=calculate_entropy,
                            vocab_shard=vocab_shard(logits.size(-1)))
    if part.group.nested:
        prefix = close_micro_batch(part)
    else:
        prefix = state.prefix_stats(list(suffix.members), part.last)
        if part.last:
            part.group.held_bytes = state.prefix_kv.held_bytes()
            part.group.state = None  # the last micro-batch's graph holds what its backward needs
    if metrics is not None:
        metrics.add_tokens(part.tokens_total, part.tokens_computed)
    result = {"log_probs": (prefix[0], stats.log_probs)}
    if calculate_entropy:
        result["entropy"] = (prefix[1], stats.entropy)
    return {key: torch.nested.as_nested_tensor(
                [torch.cat([head, tail]) for head, tail in zip(rows, tail_plan.split(own))],
                layout=torch.jagged)
            for key, (rows, own) in result.items()}


def check_cross_engine_setup(engine_config: Any) -> None:
    """At engine construction: the parallel settings of verl's Megatron engine config under
    which a group cannot run across micro-batches (:func:`check_cross_model` checks the model
    itself at its first cross micro-batch)."""
    found = []
    pp = getattr(engine_config, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        found.append(Refused("verl.cross_micro_batch.layout", f"pipeline_model_parallel_size={pp}"))
    vpp = getattr(engine_config, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp > 1:
        found.append(Refused("verl.cross_micro_batch.layout",
                             f"virtual_pipeline_model_parallel_size={vpp}"))
    cp = getattr(engine_config, "context_parallel_size", 1) or 1
    if cp > 1:
        found.append(Refused("verl.cross_micro_batch.layout", f"context_parallel_size={cp}"))
    replay = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if replay not in (None, "disabled"):
        found.append(Refused("verl.cross_micro_batch.router_replay",
                             f"router_replay.mode={replay!r}"))
    if found:
        raise refuse_all(found, error=PrefixSharingSetupError)


def check_cross_model(model) -> None:
    """The group driver's refusals (PP), plus MoE routers with batch statistics under
    sequence parallelism: at TP=1 they equal verl's stock step forced onto the same split
    (tested); under sequence parallelism that comparison does not hold yet (the group driver's
    own does, against megatron's stock step)."""
    from megatron.core.utils import get_attr_wrapped_model

    from ..megatron_ext.cross_micro_batch import check_group_model
    from ..megatron_ext.moe import PrefixSharingRouter

    check_group_model(model)
    config = get_attr_wrapped_model(model, "config")
    keeping = [name for name, module in model.named_modules()
               if isinstance(module, PrefixSharingRouter) and module.keeps_statistics()]
    if config.num_moe_experts and keeping and config.sequence_parallel:
        raise refuse("verl.cross_micro_batch.router_statistics",
                     f"num_moe_experts={config.num_moe_experts} with sequence_parallel=True; "
                     f"{keeping[0]}", error=PrefixSharingSetupError)


def _run_prefix(model, part: CrossPart, sharing: PrefixSharingConfig, temperature: float,
                with_entropy: bool, device: torch.device) -> GroupState:
    """The group's prefix forward (recording its K/V) and its prefix-position statistics."""
    from ..megatron_ext.cross_micro_batch import PrefixPass
    from ..megatron_ext.prefix_kv import PrefixKV

    schedule = part.group.schedule
    # its block is planned padded as the group's other micro-batches are (microbatch.py):
    # its pad rows are not kept
    prefix_kv = PrefixKV(rows=schedule.prefix_len)
    prefix = PrefixPass(schedule, prefix_kv, sharing.backend, temperature, device)
    log_probs, entropy, _ = prefix.stats(model, with_entropy)
    shape = (len(schedule.seq_lens), schedule.prefix_len)
    log_probs = log_probs.view(shape)
    entropy = entropy.view(shape) if entropy is not None else None
    leaves = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad)
                   for t in (log_probs, entropy))
    return GroupState(prefix_kv, log_probs, entropy, leaves, temperature)
