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
``seq_aux_loss`` the view is the packed plain batch (no padding), which gives the same statistics
when one rank routes the whole batch.

Under tensor parallelism megatron-core's MoE needs sequence parallelism, and its stock spec
then routes on each rank a slice of the plain ``[s, b]`` batch along ``s`` (``s`` a multiple of
the tensor-parallel size), with per-rank statistics: the z-loss is this slice's mean divided by
the tensor-parallel size, the load-balancing losses combine this slice's probabilities with the
counts all-reduced over the group, the expert-bias counts are this slice's. So each rank gathers
the flat router logits of the whole group (``gather_from_sequence_parallel_region``: its
backward reduce-scatters, so the router weight's per-rank gradients are the stock ones), routes
its own slice of the padded plain batch exactly as the stock router does, and all-gathers the
slices' probabilities and expert choices: the copy a flat row takes may lie in another rank's
slice. The plain view is then always the padded one, since the slices decide the statistics.

"Sequence" in ``seq_aux_loss`` is a sequence of the micro-batch, as in megatron's padded
``[s, b]`` input. (On a plain THD batch megatron-core 0.16.1 does not read ``cu_seqlens`` there:
its ``[T, 1]`` input makes the whole micro-batch one sequence.)

Cost: the router's tensors (``num_experts`` numbers per token) are the plain batch's size, not the
flat layout's - small next to the hidden states and the experts, which stay flat; under sequence
parallelism, three all-gathers of them per layer (logits, probabilities, expert choices). Without
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
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
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
    ``b = [5 6 7 9 9]``, ``c = [5 6]``; 6 flat rows, sentinel 6), per sequence, one shard::

        rows = [[0 0 0]       one column per sequence, one row per position ([s, b])
                [1 1 1]
                [2 2 6]
                [3 4 6]
                [6 5 6]]
        padding_mask = rows == 6
        readers = [0 3 6 9 10 13]   a flat row's first position in the plain batch, rows.view(-1)

    Under sequence parallelism with 2 shards, ``s`` is rounded up to 6 (a padding row of 6s
    appended) and split like megatron splits the plain ``[s, b]`` batch: rank 0 routes
    ``rows[:3]``, rank 1 ``rows[3:]``; each rank's ``readers`` are those of its own half of the
    flat rows, as positions of the whole plain batch (``[0 3 6]`` on rank 0, ``[9 10 13]`` on
    rank 1), since a flat row's readers may sit in the other rank's half.

    Without per-sequence statistics and sequence parallelism the view is the plain batch as one
    packed sequence, ``rows = kv_index[:, None]`` (no padding), which is smaller when lengths
    differ a lot.

    Attributes:
        rows: ``[s / shards, b]`` int64, the flat row of every plain position of this shard;
            ``num_tokens_flat`` (the sentinel, a row of zeros) where a sequence is shorter
            than ``s``.
        padding_mask: ``[s / shards, b]`` bool, True at the sentinel (megatron's convention), or
            None.
        readers: ``(T_flat / shards,)`` int64, for each flat row of this shard one position of
            the whole plain batch (all shards' ``rows.view(-1)`` concatenated) that reads it; the
            plan's pad rows, which no sequence reads, take position 0.
    """

    rows: torch.Tensor
    padding_mask: torch.Tensor | None
    readers: torch.Tensor

    @classmethod
    def of(cls, plan: SharingPlan, per_sequence: bool, shards: int = 1,
           shard: int = 0) -> PlainBatchView:
        """Shard ``shard`` of ``shards`` of the view of ``plan``: padded per sequence, or the
        packed plain batch (one shard only)."""
        if plan.num_tokens_flat % shards:
            raise ValueError(f"the flat layout's {plan.num_tokens_flat} rows do not split into "
                             f"{shards} sequence-parallel shards; plan with pad_to_multiple_of="
                             f"{shards}")
        if shards > 1 and not per_sequence:
            raise ValueError("the packed plain batch has one shard; shard it per sequence")
        kv_index = plan.kv_index
        if per_sequence:
            sentinel = plan.num_tokens_flat
            packed = torch.arange(plan.num_tokens_total, device=kv_index.device)
            seq = torch.searchsorted(plan.cu_seqlens[1:], packed, right=True)
            pos = packed - plan.cu_seqlens.index_select(0, seq)
            length = max(plan.seq_lens)
            length += -length % shards  # megatron splits the padded s evenly
            rows = torch.full((length, plan.num_sequences), sentinel,
                              dtype=torch.int64, device=kv_index.device)
            rows[pos, seq] = kv_index  # [s, b]
        else:
            rows = kv_index.unsqueeze(1)  # [T_total, 1]
        positions = torch.arange(rows.numel(), device=kv_index.device)
        # one slot more, for the sentinel: padding positions land there and are dropped
        readers = torch.zeros(plan.num_tokens_flat + 1, dtype=torch.int64,
                              device=kv_index.device)
        readers.scatter_reduce_(0, rows.reshape(-1), positions, "amin", include_self=False)
        rows = rows.chunk(shards)[shard]
        return cls(rows, rows == plan.num_tokens_flat if per_sequence else None,
                   readers[:-1].chunk(shards)[shard])

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """``[s / shards, b, E]`` this shard's plain-batch rows of all flat rows ``[T_flat, E]``
        (zeros at padding)."""
        with_sentinel = torch.cat([flat, flat.new_zeros(1, flat.size(1))])  # [T_flat + 1, E]
        return with_sentinel.index_select(0, self.rows.reshape(-1)).view(*self.rows.shape, -1)

    def select(self, plain: torch.Tensor) -> torch.Tensor:
        """This shard's flat ``[T_flat / shards, E]`` rows of the whole plain batch
        ``[s * b, E]``: each row's first reader."""
        return plain.index_select(0, self.readers)


# A plan's views, built once per micro-batch and shared by every MoE layer (the plan is frozen).
_VIEWS: weakref.WeakKeyDictionary[SharingPlan, dict[tuple[bool, int, int], PlainBatchView]] = (
    weakref.WeakKeyDictionary()
)


def plain_batch_view(plan: SharingPlan, per_sequence: bool, shards: int = 1,
                     shard: int = 0) -> PlainBatchView:
    """:meth:`PlainBatchView.of`, cached per plan."""
    views = _VIEWS.setdefault(plan, {})
    key = (per_sequence, shards, shard)
    if key not in views:
        views[key] = PlainBatchView.of(plan, per_sequence, shards, shard)
    return views[key]


class PrefixSharingRouter(TopKRouter):
    """``TopKRouter`` whose batch statistics count tokens as the plain micro-batch holds them.

    Given a plan (by :class:`PrefixSharingTransformerLayer`), it routes the plain batch's logits
    (see the module doc) whenever megatron would keep a statistic, so ``aux_loss``,
    ``seq_aux_loss`` (each sequence is a column, as in megatron's padded ``[s, b]`` layout),
    ``global_aux_loss``, the z-loss, the expert-bias counts and the aux-loss tracker are
    megatron's own on the plain batch - under sequence parallelism, each rank's are the stock
    router's on that rank's slice of it.
    """

    def __init__(self, config: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        # kwargs: what the release's MoELayer also passes (0.17+: is_mtp_layer)
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)
        self._plan: SharingPlan | None = None
        # The layer class that hands this router its plan (set by that layer); a router no layer
        # feeds would route the flat rows as if they were the plain batch.
        self.fed_by: str | None = None

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
        # Under sequence parallelism this rank holds a 1/shards slice of the flat rows, and
        # megatron's stock spec routes a 1/shards slice (along s) of the plain [s, b] batch.
        shards = self.tp_group.size() if self.config.sequence_parallel else 1
        view = plain_batch_view(self._plan,
                                self.get_aux_loss_coeff("seq_aux_loss") > 0 or shards > 1,
                                shards, self.tp_group.rank() if shards > 1 else 0)
        flat_logits = logits.reshape(-1, self.num_experts)  # [T_flat / shards, E]
        if shards > 1:  # backward: reduce-scatter, each rank's uses of every row summed
            flat_logits = gather_from_sequence_parallel_region(flat_logits, group=self.tp_group)
        plain_logits = view.gather(flat_logits)  # [s / shards, b, E]
        probs, routing_map = super().routing(plain_logits, padding_mask=view.padding_mask)
        if shards > 1:  # this rank's flat rows may be read in another rank's slice
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_group)
            routing_map = gather_from_sequence_parallel_region(routing_map, group=self.tp_group)
        return view.select(probs), view.select(routing_map)  # [T_flat / shards, E] each

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

    def keeps_statistics(self) -> bool:
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
        router.fed_by = type(self).__qualname__
        if self.mlp.moe_layer_recompute and router.keeps_statistics():
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
