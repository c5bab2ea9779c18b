"""A Megatron-LM packed micro-batch, split into its sequences, planned, with its loss targets.

Megatron-LM's SFT data (``megatron/training/datasets/sft_dataset.py``) hands the forward step
``[b, s]`` packs: ``tokens``, ``labels`` (the pack shifted by one), ``loss_mask`` (0 on prompts
and padding) and ``cu_seqlens`` (``[b, s + 1]``: each pack's conversation boundaries, then
``s`` repeated to a fixed width). Each conversation is one sequence for the planner - positions
restart at 0 per conversation, so a conversation is exactly a sequence - and the pack's trailing
padding belongs to its last conversation, as Megatron-LM's own THD batch has it.

The loss is Megatron-LM's: the sum of ``loss_mask * cross_entropy(logits, labels)`` over every
token of the batch, and the token count ``loss_mask.sum()``. Each token's logits are the flat row
that computed it (``plan.kv_index``); tokens that share a row *and* a label are scored once,
weighted by their summed mask, so a prefix shared by ten conversations is not gathered ten times.
All of this is host work done once per micro-batch, before the model runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..config import PrefixSharingConfig
from ..errors import InputError
from ..megatron_ext.packed_seq import MicroBatch, prepare_micro_batch

__all__ = ["LossTargets", "PlannedBatch", "split_packs", "plan_packed_batch"]


@dataclasses.dataclass(frozen=True)
class LossTargets:
    """What the loss reads from the flat logits.

    Attributes:
        rows: ``(n,)`` int64, flat rows whose logits are scored.
        labels: ``(n,)`` int64, the label scored at each row.
        weights: ``(n,)`` float32, the summed ``loss_mask`` of the plain tokens each
            ``(row, label)`` pair stands for.
        num_tokens: ``()`` int64, ``loss_mask.sum()`` of the plain batch (Megatron-LM's count).
    """

    rows: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    num_tokens: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    """One planned micro-batch: the model's inputs, the loss targets, and the token counts."""

    micro_batch: MicroBatch
    targets: LossTargets

    @property
    def tokens_total(self) -> int:
        """Tokens of the micro-batch's sequences: what the plain forward computes."""
        return self.micro_batch.plan.num_tokens_total

    @property
    def tokens_computed(self) -> int:
        """Tokens the plan computes (its flat layout without padding)."""
        return self.micro_batch.plan.num_tokens_unique


def split_packs(
    tokens: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> list[tuple[int, int, int]]:
    """The sequences of ``[b, s]`` packs as ``(pack, start, end)`` spans, packs in order.

    ``cu_seqlens`` is ``[b, k]`` (or ``[k]`` for one pack): each row starts with 0, rises
    strictly, and may repeat its last value (``s``) to a fixed width; without it every pack is
    one sequence. Raises ``ValueError`` for boundaries that do not cover a pack exactly.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [micro_batch, seq_length]; got {tuple(tokens.shape)}")
    b, s = tokens.shape
    if cu_seqlens is None:
        return [(p, 0, s) for p in range(b)]
    bounds = cu_seqlens.reshape(b, -1).to("cpu", torch.int64).numpy()
    spans = []
    for p in range(b):
        row = bounds[p]
        ends = np.flatnonzero(row == s)
        if row[0] != 0 or ends.size == 0:
            raise ValueError(f"pack {p}: cu_seqlens {row.tolist()} do not start at 0 and reach {s}")
        row = row[: ends[0] + 1]
        if np.any(np.diff(row) <= 0):
            raise ValueError(f"pack {p}: cu_seqlens {row.tolist()} are not strictly increasing")
        spans += [(p, int(a), int(e)) for a, e in zip(row[:-1], row[1:])]
    return spans


def plan_packed_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    config: PrefixSharingConfig,
    *,
    device: torch.device | str | None = None,
    mtp_num_layers: int | None = None,
) -> PlannedBatch:
    """Plans a packed micro-batch (``[b, s]`` tensors, as Megatron-LM's data loader gives them).

    Every tensor-parallel rank and pipeline stage calls this on its own copy of the batch and
    gets the same plan. ``config.mode="off"`` gives the identity plan: the same model, nothing
    shared. ``mtp_num_layers``: the model's multi-token-prediction depths, planned with the
    loss mask (:func:`~prefix_sharing.megatron_ext.packed_seq.prepare_micro_batch`).
    """
    tokens_host = tokens.to("cpu", torch.int64)
    spans = split_packs(tokens_host, cu_seqlens)
    sequences = [tokens_host[p, a:e] for p, a, e in spans]
    label_parts = [labels.to("cpu", torch.int64)[p, a:e] for p, a, e in spans]
    mask_parts = [loss_mask.to("cpu", torch.float32)[p, a:e] for p, a, e in spans]
    mtp = {}
    if mtp_num_layers:
        _check_next_token_labels(sequences, label_parts, mask_parts)
        mtp = dict(mtp_num_layers=mtp_num_layers, loss_mask=mask_parts)
    mb = prepare_micro_batch(sequences, config, device=device, **mtp)
    labels_host = torch.cat(label_parts)
    mask_host = torch.cat(mask_parts)
    targets = _loss_targets(mb.plan.kv_index.to("cpu"), labels_host, mask_host)
    device = mb.input_ids.device
    return PlannedBatch(mb, LossTargets(*(t.to(device) for t in dataclasses.astuple(targets))))


def _check_next_token_labels(sequences: list[torch.Tensor], labels: list[torch.Tensor],
                             masks: list[torch.Tensor]) -> None:
    """The MTP depths score each sequence's own later tokens, as megatron rolls the labels
    within each packed sequence: every scored label must be the sequence's next token, so no
    sequence's last position may be scored (its label lies outside it)."""
    for i, (tokens, label, mask) in enumerate(zip(sequences, labels, masks)):
        scored = mask[:-1] != 0
        if mask[-1] != 0 or not torch.equal(label[:-1][scored], tokens[1:][scored]):
            raise InputError(f"multi-token prediction: sequence {i} scores a label that is not "
                             "its next token (or scores its last position); the MTP depths "
                             "read each sequence's own later tokens")


def _loss_targets(kv_index: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> LossTargets:
    """Masked tokens as unique ``(row, label)`` pairs with their summed mask (host tensors)."""
    scored = mask != 0
    rows, picked, weights = kv_index[scored], labels[scored], mask[scored]
    if picked.numel() and int(picked.min()) < 0:
        raise ValueError("a token with a non-zero loss_mask has a negative label")
    span = int(picked.max()) + 1 if picked.numel() else 1
    pairs, inverse = torch.unique(rows * span + picked, return_inverse=True)
    summed = torch.zeros(pairs.numel(), dtype=torch.float32).index_add_(0, inverse, weights)
    num_tokens = mask.sum().round().to(torch.int64)
    return LossTargets(pairs // span, pairs % span, summed, num_tokens)
