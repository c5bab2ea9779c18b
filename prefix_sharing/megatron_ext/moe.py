"""Mixture-of-experts under prefix sharing: the router's batch statistics over the plain batch.

Everything an MoE layer does per token - gating, top-k, the experts - is already exact on the
flat layout. What is not are the router's *batch statistics*: the load-balancing losses
(``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``), the z-loss, the expert-bias token counts
and the logged metrics. A flat row that ``m`` sequences read stands for ``m`` tokens of the plain
batch, and a shared row belongs to every sequence that reads it.

So, while batch statistics are being kept, the router routes the *plain batch's* logits: the flat
router logits are gathered into the padded ``[s, b]`` layout of the plain micro-batch (one column
per sequence, a flat row repeated wherever a sequence reads it, padding flagged by megatron's own
``padding_mask``), megatron-core's ``TopKRouter.routing`` runs unchanged on that, and every flat row
then takes the probabilities and expert choice of one of its copies (all copies are equal). Every
statistic is therefore megatron's own, computed on exactly what megatron's stock spec sees for the
plain padded batch with its ``padding_mask``; the gradients follow through the gather. Without
``seq_aux_loss`` the view is the packed plain batch (no padding), which gives the same statistics.

"Sequence" in ``seq_aux_loss`` is a sequence of the micro-batch, as in megatron's padded
``[s, b]`` input. (On a plain THD batch megatron-core 0.16.1 does not read ``cu_seqlens`` there:
its ``[T, 1]`` input makes the whole micro-batch one sequence.)

Cost: the router's tensors (``num_experts`` numbers per token) are the plain batch's size, not the
flat layout's - small next to the hidden states and the experts, which stay flat. Without
statistics (evaluation, no aux/z-loss, no expert bias) the flat rows are routed directly.

The plan reaches the router through the layer spec: :class:`PrefixSharingTransformerLayer`
receives ``packed_seq_params`` like every layer and hands its plan to its own router for the
duration of its forward (also when full recomputation replays that forward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..plan import SharingPlan
from .checks import UnsupportedSetupError
from .packed_seq import PlanPackedSeqParams

__all__ = ["PlainBatchView", "PrefixSharingRouter", "PrefixSharingTransformerLayer"]


@dataclasses.dataclass(frozen=True)
class PlainBatchView:
    """Where each position of the plain micro-batch reads its flat row, for the router.

    Worked example, the plan of :class:`~prefix_sharing.plan.SharingPlan` (``a = [5 6 7 8]``,
    ``b = [5 6 7 9 9]``, ``c = [5 6]``; 6 flat rows, sentinel 6), per sequence::

        rows = [[0 0 0]       one column per sequence, one row per position ([s, b])
                [1 1 1]
                [2 2 6]
                [3 4 6]
                [6 5 6]]
        padding_mask = rows == 6
        first_reader = [0 3 6 9 10 13]   a flat row's first position in rows.view(-1)

    Without per-sequence statistics the view is the plain batch as one packed sequence,
    ``rows = kv_index[:, None]`` (no padding), which is smaller when lengths differ a lot.

    Attributes:
        rows: ``[s, b]`` int64, the flat row of every plain position; ``num_tokens_flat`` (the
            sentinel, a row of zeros) where a sequence is shorter than ``s``.
        padding_mask: ``[s, b]`` bool, True at the sentinel (megatron's convention), or None.
        first_reader: ``(T_flat,)`` int64, for each flat row one position of ``rows.view(-1)``
            that reads it; the plan's pad rows, which no sequence reads, take position 0.
    """

    rows: torch.Tensor
    padding_mask: torch.Tensor | None
    first_reader: torch.Tensor

    @classmethod
    def of(cls, plan: SharingPlan, per_sequence: bool) -> PlainBatchView:
        """The view of ``plan``: padded per sequence, or the packed plain batch."""
        kv_index = plan.kv_index
        if per_sequence:
            sentinel = plan.num_tokens_flat
            packed = torch.arange(plan.num_tokens_total, device=kv_index.device)
            seq = torch.searchsorted(plan.cu_seqlens[1:], packed, right=True)
            pos = packed - plan.cu_seqlens.index_select(0, seq)
            rows = torch.full((max(plan.seq_lens), plan.num_sequences), sentinel,
                              dtype=torch.int64, device=kv_index.device)
            rows[pos, seq] = kv_index  # [s, b]
            padding_mask = rows == sentinel
        else:
            rows, padding_mask = kv_index.unsqueeze(1), None  # [T_total, 1]
        readers = torch.arange(rows.numel(), device=kv_index.device)
        # one slot more, for the sentinel: padding positions land there and are dropped
        first_reader = torch.zeros(plan.num_tokens_flat + 1, dtype=torch.int64,
                                   device=kv_index.device)
        first_reader.scatter_reduce_(0, rows.reshape(-1), readers, "amin", include_self=False)
        return cls(rows, padding_mask, first_reader[:-1])

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """``[s, b, E]`` plain-batch rows of a flat ``[T_flat, E]`` tensor (zeros at padding)."""
        with_sentinel = torch.cat([flat, flat.new_zeros(1, flat.size(1))])  # [T_flat + 1, E]
        return with_sentinel.index_select(0, self.rows.reshape(-1)).view(*self.rows.shape, -1)

    def select(self, plain: torch.Tensor) -> torch.Tensor:
        """Flat ``[T_flat, E]`` rows of a plain ``[s * b, E]`` tensor: each row's first reader."""
        return plain.index_select(0, self.first_reader)


# A plan's views, built once per micro-batch and shared by every MoE layer (the plan is frozen).
_VIEWS: weakref.WeakKeyDictionary[SharingPlan, dict[bool, PlainBatchView]] = (
    weakref.WeakKeyDictionary()
)


def plain_batch_view(plan: SharingPlan, per_sequence: bool) -> PlainBatchView:
    views = _VIEWS.setdefault(plan, {})
    if per_sequence not in views:
        views[per_sequence] = PlainBatchView.of(plan, per_sequence)
    return views[per_sequence]


class PrefixSharingRouter(TopKRouter):
    """``TopKRouter`` whose batch statistics count tokens as the plain micro-batch holds them.

    Given a plan (by :class:`PrefixSharingTransformerLayer`), it routes the plain batch's logits
    (see the module doc) whenever megatron would keep a statistic, so ``aux_loss``,
    ``seq_aux_loss`` (each sequence is a column, as in megatron's padded ``[s, b]`` layout),
    ``global_aux_loss``, the z-loss, the expert-bias counts and the aux-loss tracker are
    megatron's own on the plain batch.
    """

    def __init__(self, config: Any, pg_collection: Any = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self._keeps_statistics() and config.tensor_model_parallel_size > 1:
            raise UnsupportedSetupError(
                f"tensor_model_parallel_size={config.tensor_model_parallel_size} with MoE "
                "auxiliary losses, z-loss or expert bias: under sequence parallelism each rank "
                "routes a slice of the flat layout, whose statistics prefix sharing does not "
                "reweight yet; use tensor_model_parallel_size=1 (expert parallelism is fine)"
            )
        self._plan: SharingPlan | None = None

    @contextlib.contextmanager
    def reading(self, plan: SharingPlan | None) -> Iterator[None]:
        """Routes with ``plan``'s plain batch inside the block (None: the tokens as given)."""
        previous, self._plan = self._plan, plan
        try:
            yield
        finally:
            self._plan = previous

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self._plan is None or not self._computes_statistics():
            return super().routing(logits, padding_mask=padding_mask)
        if padding_mask is not None:
            raise UnsupportedSetupError(
                "a padding_mask was passed with a sharing plan: the plan already says which "
                "rows are padding; drop the padding_mask"
            )
        view = plain_batch_view(self._plan, self.get_aux_loss_coeff("seq_aux_loss") > 0)
        plain_logits = view.gather(logits.reshape(-1, self.num_experts))  # [s, b, E]
        probs, routing_map = super().routing(plain_logits, padding_mask=view.padding_mask)
        return view.select(probs), view.select(routing_map)  # [T_flat, E] each

    def _apply_expert_bias(self, routing_map: torch.Tensor,
                           padding_mask: torch.Tensor | None = None) -> None:
        """Counts each expert's tokens for the bias update, padding excluded.

        megatron-core 0.16.1's version masks ``[tokens, experts]`` with a ``[tokens]`` mask,
        which does not broadcast; this is that count with the mask per token.
        """
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def _keeps_statistics(self) -> bool:
        """Whether the config asks for any batch statistic of the router."""
        return (self.is_aux_loss_enabled() or self.config.moe_z_loss_coeff is not None
                or self.enable_expert_bias)

    def _computes_statistics(self) -> bool:
        """Whether this call computes one (megatron skips them without grad, and the losses
        outside training)."""
        if not torch.is_grad_enabled():
            return False
        losses = self.is_aux_loss_enabled() or self.config.moe_z_loss_coeff is not None
        return self.enable_expert_bias or (self.training and losses)


class PrefixSharingTransformerLayer(TransformerLayer):
    """``TransformerLayer`` that hands the micro-batch's plan to its MoE router.

    The layer receives ``packed_seq_params`` on every pipeline stage; the MoE layer does not. The
    plan is set on this layer's own router for the duration of the layer's forward only, so
    interleaved micro-batches and full recomputation (which replays this forward) see the right
    plan. Selective recomputation of the MoE module would replay the router outside it, so it is
    refused when the router keeps statistics.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        router = getattr(self.mlp, "router", None)
        if not isinstance(router, PrefixSharingRouter):
            raise ValueError(
                "PrefixSharingTransformerLayer needs an MoE mlp whose router is a "
                f"PrefixSharingRouter; got router={type(router).__name__}"
            )
        if self.mlp.moe_layer_recompute and router._keeps_statistics():
            raise UnsupportedSetupError(
                "recompute_modules contains 'moe' with MoE auxiliary losses, z-loss or expert "
                "bias: the recomputed router would run outside the layer that knows the "
                "sharing plan; use recompute_granularity='full' or drop 'moe'"
            )

    def forward(self, *args: Any, **kwargs: Any):
        params = kwargs.get("packed_seq_params")
        plan = params.plan if isinstance(params, PlanPackedSeqParams) else None
        with self.mlp.router.reading(plan):
            return super().forward(*args, **kwargs)
