"""The forward step Megatron-LM's ``pretrain()`` runs for every micro-batch, with sharing.

Megatron-LM calls ``forward_step(data_iterator, model)`` on every pipeline stage. Each stage
(and each tensor-parallel rank) reads the micro-batch from its own iterator - the data provider
is marked ``is_distributed`` - plans it, and runs ``GPTModel`` on the plan's flat layout; only
activations cross stages, as with any Megatron model. The last stage's loss function scores the
restored per-token logits against the batch's labels under its loss mask and returns Megatron-LM's
triple ``(loss sum, token count, {name: [sum, count]})``, so Megatron's per-token averaging
(``--calculate-per-token-loss`` or not) is unchanged.

Besides ``lm loss`` the report carries the sharing figures, summed over the iteration's
micro-batches and data-parallel ranks by Megatron-LM's own reduction (``[value, 1 / (micro-batches
x data-parallel ranks)]`` pairs sum to ``value`` per iteration):

- ``tokens total``: tokens of the iteration's sequences (what the plain forward computes);
- ``tokens computed``: tokens its plans compute;
- ``token ratio``: total over computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import PrefixSharingConfig
from ..megatron_ext.mtp import share_multi_token_prediction
from ..refusals import refuse
from .batch import PlannedBatch, plan_packed_batch

__all__ = ["make_forward_step", "loss_func"]


def make_forward_step(config: PrefixSharingConfig) -> Callable[..., tuple[torch.Tensor, Callable]]:
    """Megatron-LM's ``forward_step_func`` for ``config`` (``mode="off"``: the identity plan)."""

    def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module,
                     return_schedule_plan: bool = False) -> tuple[torch.Tensor, Callable]:
        if return_schedule_plan:  # check_megatron_args refuses the option that asks for it
            raise refuse("megatron_lm.combined_1f1b", "return_schedule_plan=True")

        from megatron.training import get_args, get_timers

        timers = get_timers()
        timers("batch-generator", log_level=2).start()
        batch = next(data_iterator)
        depths = get_args().mtp_num_layers
        planned = plan_packed_batch(
            batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("cu_seqlens"), config,
            mtp_num_layers=depths,
        )
        if depths:  # Megatron-LM built the MTP block stock around the sharing layer spec
            share_multi_token_prediction(model)
        timers("batch-generator").stop()
        mb = planned.micro_batch
        output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        return output, functools.partial(loss_func, planned)

    return forward_step


def loss_func(planned: PlannedBatch, output_tensor: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron-LM's loss on the last pipeline stage: the masked sum and its token count.

    ``output_tensor`` is ``GPTModel``'s ``[1, T_flat, V_local]`` logits (vocab-parallel).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    targets = planned.targets
    logits = output_tensor[0].index_select(0, targets.rows)  # [n, V_local]
    losses = tensor_parallel.vocab_parallel_cross_entropy(
        logits.float().unsqueeze(1), targets.labels.unsqueeze(1)
    )  # [n, 1]
    loss = (losses.view(-1) * targets.weights).sum()
    num_tokens = targets.num_tokens.to(torch.int)
    share = 1.0 / (get_num_microbatches() * parallel_state.get_data_parallel_world_size())
    device = loss.device
    report = {
        "lm loss": torch.stack([loss.detach(), num_tokens.to(loss.dtype)]),
        "tokens total": torch.tensor([planned.tokens_total, share], device=device),
        "tokens computed": torch.tensor([planned.tokens_computed, share], device=device),
        "token ratio": torch.tensor(
            [planned.tokens_total, planned.tokens_computed], dtype=torch.float32, device=device
        ),
    }
    return loss, num_tokens, report
