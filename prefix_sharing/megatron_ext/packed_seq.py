"""The plan travels to every layer inside Megatron's own packed-sequence parameters.

``GPTModel.forward`` already hands ``packed_seq_params`` to every layer's attention, on every
pipeline stage, so a ``PackedSeqParams`` subclass that also carries the plan needs no new
plumbing. Its fields say exactly what Megatron's THD code reads:

- ``cu_seqlens_q`` / ``cu_seqlens_kv``: the plan's query and key segments (they differ as soon
  as anything is shared: a reuser's keys include its provider's prefix);
- ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded``: where the tokens sit *in the tensors*.
  Keys and values are computed for the flat layout only, so both equal ``cu_seqlens_q``. Megatron's
  THD RoPE reads these, which keeps it aligned with the flat tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

import numpy as np

from ..config import PrefixSharingConfig
from ..plan import SharingPlan
from ..planner import PromptGroup, TokenSequence, build_plan
from ..prefix_kv import PrefixKV, PrefixKVPass, PrefixKVStack
from ..refusals import refuse
from .checks import UnsupportedSetupError, assert_same_plan
from .context_parallel import ContextParallelSlice, slice_plan
from .mtp import plan_mtp_depths
from .routing_replay import flat_routes

__all__ = [
    "PlanPackedSeqParams",
    "MicroBatch",
    "prepare_micro_batch",
    "PlainMicroBatch",
    "plain_micro_batch",
]


@dataclasses.dataclass
class PlanPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` (``qkv_format="thd"``) carrying the micro-batch's sharing plan.

    Attributes:
        plan: the :class:`SharingPlan`, on the model's device.
        backend: attention kernel for the prefix-sharing core attention (``"auto"``, ``"torch"``,
            ``"flash_attn"``, ``"te"``, ``"npu"``).
        cp: this context-parallel rank's slice of the plan (``None`` without context
            parallelism).
        prefix_kv: a group's prefix K/V across micro-batches
            (:mod:`prefix_sharing.megatron_ext.cross_micro_batch`): recorded by the prefix
            micro-batch, read by a suffix micro-batch whose plan addresses those rows first;
            this forward's view of them, its mode fixed when the params were built (a
            recomputed layer replays it: :class:`~prefix_sharing.prefix_kv.PrefixKVPass`).
        routes: ``[T_flat, moe_layers, topk]`` int64, the recorded route of every flat row, for
            MoE routing replay (:mod:`.routing_replay`), or ``None``.
        record_routes: the routers record the flat rows' routes in this forward (read them
            with :func:`.routing_replay.recorded_routes`).
        mtp: each multi-token-prediction depth's layout (:class:`.mtp.MTPDepth`), or
            ``None``: the model's MTP layers do not run in this forward.
    """

    plan: SharingPlan | None = None
    backend: str = "auto"
    cp: ContextParallelSlice | None = None
    prefix_kv: PrefixKVPass | PrefixKVStack | None = None
    routes: torch.Tensor | None = None
    record_routes: bool = False
    mtp: tuple | None = ()
    _rotary_cache: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def from_plan(cls, plan: SharingPlan, backend: str = "auto", *,
                  cp: ContextParallelSlice | None = None,
                  prefix_kv: PrefixKV | PrefixKVPass | PrefixKVStack | None = None,
                  routes: torch.Tensor | None = None,
                  record_routes: bool = False,
                  mtp: tuple | None = ()) -> PlanPackedSeqParams:
        """The params of one forward of ``plan``; a :class:`~prefix_sharing.prefix_kv.PrefixKV`
        (or a stack of them) is bound here, in its current mode, for this forward and its
        recomputed layers."""
        if isinstance(prefix_kv, (PrefixKV, PrefixKVStack)):
            prefix_kv = prefix_kv.forward_pass()
        return cls(
            qkv_format="thd",
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_kv=plan.cu_seqlens_kv,
            cu_seqlens_q_padded=plan.cu_seqlens_q,
            cu_seqlens_kv_padded=plan.cu_seqlens_q,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_kv=plan.max_seqlen_kv,
            plan=plan,
            backend=backend,
            cp=cp,
            prefix_kv=prefix_kv,
            routes=routes,
            record_routes=record_routes,
            mtp=mtp,
        )

    def per_token_rotary(self, table: torch.Tensor) -> torch.Tensor:
        """Rotary frequencies of each flat token at its absolute position: ``[T_flat, 1, 1, d]``
        (this context-parallel rank's rows only: ``[T_flat / CP, 1, 1, d]``).

        Megatron's THD RoPE restarts positions at 0 per segment, which is wrong for a reuser's
        tail (it starts at its prefix length); with one row per flat token the rotation is
        elementwise. Every layer receives the same table, so the rows are gathered once per
        micro-batch (the last table's result is kept on this object).
        """
        cached = self._rotary_cache
        if cached is not None and cached[0] is table:
            return cached[1]
        if self.plan.max_seqlen_kv > table.size(0):
            raise ValueError(
                f"a sequence of {self.plan.max_seqlen_kv} tokens is longer than the rotary table "
                f"({table.size(0)} positions)"
            )
        positions = self.plan.position_ids if self.cp is None else self.cp.position_ids
        rows = table.index_select(0, positions)
        self._rotary_cache = (table, rows)
        return rows


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """What ``GPTModel.forward`` needs for one planned micro-batch (``[1, T_flat]`` THD inputs;
    under context parallelism ``[1, T_flat / CP]``, this rank's rows, and ``cp`` its slice)."""

    plan: SharingPlan
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: PlanPackedSeqParams
    cp: ContextParallelSlice | None = None


def prepare_micro_batch(
    sequences: Sequence[TokenSequence],
    config: PrefixSharingConfig | None = None,
    *,
    groups: Sequence[PromptGroup] | None = None,
    pad_to_multiple_of: int | None = None,
    device: torch.device | str | None = None,
    routes: Sequence[TokenSequence] | None = None,
    replay_routes: bool = True,
    record_routes: bool = False,
    mtp_num_layers: int | None = None,
    loss_mask: Sequence[TokenSequence] | None = None,
) -> MicroBatch:
    """Plans a micro-batch and builds the ``GPTModel`` inputs for it.

    Every tensor-parallel rank and pipeline stage calls this on its own copy of the micro-batch
    and gets the same plan (the planner is deterministic), so only activations cross stages.

    Args:
        sequences: the micro-batch's token ids, one unpadded 1-D sequence each.
        config: what to share (``PrefixSharingConfig()`` when omitted).
        groups: prompt groups, for ``mode="prompt_only"``.
        pad_to_multiple_of: pad the flat layout to this multiple; defaults to the
            tensor-parallel size times the context-parallel size (context parallelism splits
            the rows across its ranks, then sequence parallelism each slice across TP).
        device: where the model runs; defaults to the current CUDA device, else CPU.
        routes: recorded MoE routes to replay (``moe_enable_routing_replay=True``), one
            ``[L_i, moe_layers, topk]`` integer array per sequence (verl's ``routed_experts``
            layout, MoE layers of the whole model): prefixes are shared only as far as the
            routes agree, and every computed row replays its tokens' route.
        replay_routes: ``False``: plan with ``routes`` but replay nothing - a forward (or a
            pipeline stage without MoE layers) that must lay the micro-batch out as the
            replaying ones do.
        record_routes: the MoE routers record their routes in this forward (their
            ``RouterReplay`` set to ``RECORD``); read them per plain token with
            :func:`~prefix_sharing.megatron_ext.routing_replay.recorded_routes`.
        mtp_num_layers: the model's ``mtp_num_layers``: each multi-token-prediction depth is
            planned too (:mod:`.mtp`), its loss scored by the model in the same forward; 0:
            the model's MTP layers do not run in this forward (verl's forward when it does not
            train them).
        loss_mask: with ``mtp_num_layers``: megatron's ``loss_mask`` of the MTP loss, one array
            per sequence (position ``t`` weighs the prediction of token ``t + 1``; default 1
            but at each sequence's last position).

    Returns:
        A :class:`MicroBatch`; call ``model(mb.input_ids, mb.position_ids, None,
        packed_seq_params=mb.packed_seq_params)``. Under context parallelism every rank of
        the CP group must call this for the same micro-batch (the plans are compared, one small
        all-gather).
    """
    config = PrefixSharingConfig() if config is None else config
    cp_group = _context_parallel_group()
    cp_size = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    if pad_to_multiple_of is None:
        pad_to_multiple_of = _tensor_parallel_size() * cp_size
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    plan = build_plan(sequences, config, groups=groups, pad_to_multiple_of=pad_to_multiple_of,
                      routes=routes)
    cp = None
    if cp_group is not None:
        assert_same_plan(plan, cp_group)
        cp = slice_plan(plan, torch.distributed.get_rank(cp_group), cp_size, cp_group,
                        device)  # host work, once per micro-batch
    replayed = None if routes is None or not replay_routes else flat_routes(plan, routes, device)
    mtp = None if mtp_num_layers == 0 else ()
    if mtp_num_layers:
        if routes is not None:
            raise refuse("megatron.mtp", "routes replayed", error=UnsupportedSetupError)
        mtp = plan_mtp_depths(sequences, plan, mtp_num_layers, config, groups=groups,
                              pad_to_multiple_of=pad_to_multiple_of, loss_mask=loss_mask,
                              device=device, cp_group=cp_group)
    elif loss_mask is not None:
        raise ValueError("loss_mask weighs the MTP loss: pass mtp_num_layers too")
    plan = plan.to(device, non_blocking=True)
    rows = slice(None) if cp is None else slice(cp.row_start, cp.row_stop)
    return MicroBatch(
        plan=plan,
        input_ids=plan.input_ids[rows].unsqueeze(0),  # [1, T_flat (/ CP)]: THD is batch 1
        position_ids=plan.position_ids[rows].unsqueeze(0),
        packed_seq_params=PlanPackedSeqParams.from_plan(plan, config.backend, cp=cp,
                                                        routes=replayed,
                                                        record_routes=record_routes,
                                                        mtp=mtp),
        cp=cp,
    )


@dataclasses.dataclass(frozen=True)
class PlainMicroBatch:
    """Megatron's stock THD inputs for a micro-batch, nothing shared: what verl runs today.

    Attributes:
        input_ids, position_ids: ``[1, T]``, every sequence followed by its own pad tokens.
        packed_seq_params: megatron's plain ``PackedSeqParams`` (``qkv_format="thd"``), so the
            model takes megatron's own THD RoPE and the core attention's plain THD path.
        token_rows: ``(T_total,)`` the row of every real token, sequences packed in the given
            order: ``logits[0].index_select(0, token_rows)`` drops the padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: PackedSeqParams
    token_rows: torch.Tensor


def plain_micro_batch(
    sequences: Sequence[TokenSequence],
    *,
    pad_to_multiple_of: int | None = None,
    device: torch.device | str | None = None,
) -> PlainMicroBatch:
    """Packs a micro-batch the way verl's ``preprocess_packed_seqs`` does, for the plain run.

    Each sequence is padded on its own to a multiple of ``pad_to_multiple_of`` (pad id 0),
    one THD segment per padded sequence: ``cu_seqlens_q = cu_seqlens_kv`` and both ``*_padded``
    are the padded boundaries, ``max_seqlen_*`` the longest padded sequence. A sequence's pad
    tokens come after its real ones, so causal attention leaves the real tokens unchanged.

    Args:
        sequences: the micro-batch's token ids, one unpadded 1-D sequence each.
        pad_to_multiple_of: defaults to the tensor-parallel size (sequence parallelism splits
            the tokens across it).
        device: where the model runs; defaults to the current CUDA device, else CPU.
    """
    if pad_to_multiple_of is None:
        pad_to_multiple_of = _tensor_parallel_size()
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    # the planner validates the batch; with nothing shared its flat layout is the plain packing
    packed = build_plan(sequences, PrefixSharingConfig(mode="off"))
    lens = np.asarray(packed.seq_lens, dtype=np.int64)
    padded = lens + (-lens % pad_to_multiple_of)
    starts = np.concatenate([[0], np.cumsum(padded)])
    rows = np.concatenate([np.arange(n) + s for n, s in zip(lens, starts)])
    input_ids = np.zeros(starts[-1], dtype=np.int64)
    input_ids[rows] = packed.input_ids.numpy()
    positions = np.concatenate([np.arange(n) for n in padded])
    cu = torch.from_numpy(starts.astype(np.int32)).to(device)
    longest = int(padded.max())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
    )
    return PlainMicroBatch(
        input_ids=torch.from_numpy(input_ids).unsqueeze(0).to(device),
        position_ids=torch.from_numpy(positions).unsqueeze(0).to(device),
        packed_seq_params=params,
        token_rows=torch.from_numpy(rows).to(device),
    )


def _context_parallel_group() -> torch.distributed.ProcessGroup | None:
    """The context-parallel group when it has more than one rank, else ``None``."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def _tensor_parallel_size() -> int:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1
