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

from ..config import PrefixSharingConfig
from ..plan import SharingPlan
from ..planner import PromptGroup, TokenSequence, build_plan

__all__ = ["PlanPackedSeqParams", "MicroBatch", "prepare_micro_batch"]


@dataclasses.dataclass
class PlanPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams`` (``qkv_format="thd"``) carrying the micro-batch's sharing plan.

    Attributes:
        plan: the :class:`SharingPlan`, on the model's device.
        backend: attention kernel for the prefix-sharing core attention (``"auto"``, ``"torch"``,
            ``"flash_attn"``, ``"te"``, ``"npu"``).
    """

    plan: SharingPlan | None = None
    backend: str = "auto"

    @classmethod
    def from_plan(cls, plan: SharingPlan, backend: str = "auto") -> PlanPackedSeqParams:
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
        )

    def per_token_rotary(self, table: torch.Tensor) -> torch.Tensor:
        """Rotary frequencies of each flat token at its absolute position: ``[T_flat, 1, 1, d]``.

        Megatron's THD RoPE restarts positions at 0 per segment, which is wrong for a reuser's
        tail (it starts at its prefix length). Given one row per packed token, it applies them
        token by token instead.
        """
        positions = self.plan.position_ids
        if int(self.plan.max_seqlen_kv) > table.size(0):
            raise ValueError(
                f"a sequence of {self.plan.max_seqlen_kv} tokens is longer than the rotary table "
                f"({table.size(0)} positions)"
            )
        return table.index_select(0, positions)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """What ``GPTModel.forward`` needs for one planned micro-batch (``[1, T_flat]`` THD inputs)."""

    plan: SharingPlan
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: PlanPackedSeqParams


def prepare_micro_batch(
    sequences: Sequence[TokenSequence],
    config: PrefixSharingConfig | None = None,
    *,
    groups: Sequence[PromptGroup] | None = None,
    pad_to_multiple_of: int | None = None,
    device: torch.device | str | None = None,
) -> MicroBatch:
    """Plans a micro-batch and builds the ``GPTModel`` inputs for it.

    Every tensor-parallel rank and pipeline stage calls this on its own copy of the micro-batch
    and gets the same plan (the planner is deterministic), so only activations cross stages.

    Args:
        sequences: the micro-batch's token ids, one unpadded 1-D sequence each.
        config: what to share (``PrefixSharingConfig()`` when omitted).
        groups: prompt groups, for ``mode="prompt_only"``.
        pad_to_multiple_of: pad the flat layout to this multiple; defaults to the
            tensor-parallel size (sequence parallelism splits the tokens across it).
        device: where the model runs; defaults to the current CUDA device, else CPU.

    Returns:
        A :class:`MicroBatch`; call ``model(mb.input_ids, mb.position_ids, None,
        packed_seq_params=mb.packed_seq_params)``.
    """
    config = PrefixSharingConfig() if config is None else config
    if pad_to_multiple_of is None:
        pad_to_multiple_of = _tensor_parallel_size()
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    plan = build_plan(sequences, config, groups=groups, pad_to_multiple_of=pad_to_multiple_of)
    plan = plan.to(device, non_blocking=True)
    return MicroBatch(
        plan=plan,
        input_ids=plan.input_ids.unsqueeze(0),  # [1, T_flat]: THD is batch 1
        position_ids=plan.position_ids.unsqueeze(0),
        packed_seq_params=PlanPackedSeqParams.from_plan(plan, config.backend),
    )


def _tensor_parallel_size() -> int:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1
