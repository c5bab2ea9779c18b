"""The plain and the shared forward+backward of a HuggingFace model, as comparable runs.

The plain run is transformers' own attention (``eager`` or ``sdpa``) on the right-padded batch
with its padding mask, log-probs from the full logits one sequence at a time: no code of this
package on its path, except the gated delta rule of Qwen3.5 / Qwen3-Next layers and the
Mamba-2 scan of Nemotron-H (:mod:`.plain_kernels`: transformers' own torch code in float32,
the token-by-token recurrence in float64). (One forward per micro-batch, as the shared run:
FSDP ranks must issue the same collectives.)
The shared run is :func:`~prefix_sharing.fsdp_compat.shared_forward` on the plan. Both return
:class:`~prefix_sharing.equivalence.RunOutputs` (gradients gathered whole under FSDP2), which
``compare_runs`` and ``within_tolerance`` judge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ..config import PrefixSharingConfig
from ..equivalence import RunOutputs, plain_token_log_probs
from ..planner import PromptGroup
from .forward import shared_forward
from .fsdp import full_gradients
from .plain_kernels import plain_gdn_kernel, plain_ssd_kernel

__all__ = ["plain_run", "plain_vlm_run", "shared_run"]


def plain_run(model: torch.nn.Module, sequences: Sequence[torch.Tensor],
              weights: torch.Tensor, temperature: float = 1.0) -> RunOutputs:
    """The padded batch through ``model``; packed logits, log-probs, entropy (of the logits
    divided by ``temperature``), loss, grads."""
    device = model.get_input_embeddings().weight.device
    lengths = [len(s) for s in sequences]
    input_ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for row, s in enumerate(sequences):
        input_ids[row, : len(s)] = s
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]  # [b, s]
    input_ids, mask = input_ids.to(device), mask.to(device)

    def forward():
        logits = model(input_ids=input_ids, attention_mask=mask.long(), use_cache=False).logits
        packed = logits[mask]  # [T_total, vocab]: the real tokens, sequence by sequence
        return (packed, *plain_token_log_probs(packed / temperature,
                                               [s.to(device) for s in sequences]))

    with plain_gdn_kernel(model), plain_ssd_kernel(model):
        run = RunOutputs.collect(model, forward, weights.to(device))
    return _with_full_gradients(model, run)


def plain_vlm_run(model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                  weights: torch.Tensor, multi_modal_inputs: Sequence[Mapping | None]) -> RunOutputs:
    """A vision-language model's stock forward, one sequence at a time with its own images
    (its mrope positions from transformers' ``get_rope_index``, its images encoded by it);
    Qwen3.5's gated delta rule as in :func:`plain_run`."""
    device = model.get_input_embeddings().weight.device
    image_token_id = model.config.image_token_id

    def forward():
        logits = []
        for seq, mm in zip(sequences, multi_modal_inputs):
            ids = seq.to(device)[None]
            mm = {k: v.to(device) for k, v in (mm or {}).items()}
            types = (ids == image_token_id).to(torch.int32)
            logits.append(model(input_ids=ids, mm_token_type_ids=types, use_cache=False,
                                **mm).logits[0])
        packed = torch.cat(logits)
        return (packed, *plain_token_log_probs(packed, [s.to(device) for s in sequences]))

    with plain_gdn_kernel(model):
        run = RunOutputs.collect(model, forward, weights.to(device))
    return _with_full_gradients(model, run)


def shared_run(model: torch.nn.Module, sequences: Sequence[torch.Tensor], weights: torch.Tensor,
               config: PrefixSharingConfig, groups: Sequence[PromptGroup] | None = None,
               temperature: float = 1.0,
               multi_modal_inputs: Sequence[Mapping | None] | None = None) -> RunOutputs:
    """The micro-batch through the sharing model (see :func:`shared_forward`), restored per token."""
    device = model.get_input_embeddings().weight.device

    def forward():
        out = shared_forward(model, sequences, config, groups=groups, temperature=temperature,
                             multi_modal_inputs=multi_modal_inputs)
        return out.plan.restore(out.logits), out.stats.log_probs, out.stats.entropy

    return _with_full_gradients(model, RunOutputs.collect(model, forward, weights.to(device)))


def _with_full_gradients(model: torch.nn.Module, run: RunOutputs) -> RunOutputs:
    return dataclasses.replace(run, grads=full_gradients(model))
