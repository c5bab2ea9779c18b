"""The accelerator kernels' documented limits, checked before the call.

A setup outside a kernel's documented range is refused here with the number and the source,
instead of failing inside the kernel with a message about its internals (or, for a limit a
kernel does not check itself, computing something else). Where a limit can be met by calling
the kernel several times, the backend does that instead (the NPU segment count).

Sources (the figures below, as their documentation states them):

- flash-attn 2 (Dao-AILab/flash-attention ``README.md``, "FlashAttention-2 ... supports all head
  dimensions up to 256"; ``flash_attn_varlen_func``: fp16 and bf16 only).
- Transformer Engine: ``transformer_engine/common/fused_attn/fused_attn.cpp``
  ``nvte_get_fused_attn_backend``: ``padding_causal_bottom_right`` with the THD format needs
  cuDNN >= 9.6 and, before TE 2.2, ``max_seqlen_q`` and ``max_seqlen_kv`` multiples of 64
  (TE 2.2 lifts that with cuDNN >= 9.7: "9.7: removes s_q/s_kv % 64 = 0 for
  {causal_bottom_right, padding_causal_bottom_right}"); THD needs sm90+; head dims at most 256
  (sm90+). TE's unfused attention has no THD path in training, so a varlen segment layout with
  arbitrary lengths has no TE kernel before 2.2 unless TE's flash-attn path takes it.
- torch_npu ``npu_fusion_attention`` (Ascend/op-plugin
  ``docs/context/torch_npu-npu_fusion_attention.md``, constraints): "actual_seq_qlen 的长度取值
  范围为 1~2K, varlen 场景下长度最大支持 1K" - at most 1024 segments per TND call; head dim
  ``D`` 1~768; query heads ``Nq`` 1~256, a multiple of ``Nkv``; float16, bfloat16, float32.
"""

from __future__ import annotations

import functools
import re

import torch
from ..refusals import Refused, refuse, refuse_all



__all__ = [
    "FLASH_ATTN_MAX_HEAD_DIM",
    "TE_MIN_VERSION",
    "TE_MAX_HEAD_DIM",
    "NPU_MAX_SEGMENTS",
    "NPU_MAX_HEAD_DIM",
    "NPU_MAX_HEADS",
    "check_flash_attn",
    "check_te",
    "check_npu",
    "segment_chunks",
]

FLASH_ATTN_MAX_HEAD_DIM = 256
TE_MIN_VERSION = (2, 2)
TE_MAX_HEAD_DIM = 256
NPU_MAX_SEGMENTS = 1024
NPU_MAX_HEAD_DIM = 768
NPU_MAX_HEADS = 256
_HALF = (torch.float16, torch.bfloat16)


def check_flash_attn(q: torch.Tensor) -> None:
    """Refuses what ``flash_attn_varlen_func`` (flash-attn 2) does not compute."""
    if q.dtype not in _HALF:
        raise refuse("kernels.dtype", f"flash-attn with q in {q.dtype}")
    if q.size(-1) > FLASH_ATTN_MAX_HEAD_DIM:
        raise refuse("kernels.head_dim", f"flash-attn 2 takes head dims up to "
                     f"{FLASH_ATTN_MAX_HEAD_DIM}; this model's is {q.size(-1)}")


def check_te(q: torch.Tensor, te_version: str) -> None:
    """Refuses a Transformer Engine older than :data:`TE_MIN_VERSION` (its FusedAttention
    takes bottom-right padding-causal THD segments of any length only from 2.2, with cuDNN
    >= 9.7), and dtypes and head dims its THD kernels do not take."""
    if _release(te_version) < TE_MIN_VERSION:
        raise refuse("kernels.te_release", f"transformer-engine {te_version}")
    if q.dtype not in _HALF:
        raise refuse("kernels.dtype", f"Transformer Engine's THD attention with q in {q.dtype}")
    if q.size(-1) > TE_MAX_HEAD_DIM:
        raise refuse("kernels.head_dim", f"Transformer Engine's THD attention takes head dims "
                     f"up to {TE_MAX_HEAD_DIM}; this model's is {q.size(-1)}")


def check_npu(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuses what ``npu_fusion_attention``'s TND layout does not take (the segment count is
    met by :func:`segment_chunks` instead)."""
    found = []
    if not 1 <= q.size(-1) <= NPU_MAX_HEAD_DIM:
        found.append(Refused("kernels.head_dim", f"npu_fusion_attention (TND): head dim "
                             f"{q.size(-1)} (1 to {NPU_MAX_HEAD_DIM})"))

    if not 1 <= q.size(1) <= NPU_MAX_HEADS:
        found.append(Refused("kernels.npu_heads",
                             f"{q.size(1)} query heads (1 to {NPU_MAX_HEADS})"))
    if q.size(1) % k.size(1):
        found.append(Refused("kernels.npu_heads", f"{q.size(1)} query heads over {k.size(1)} "
                             "key/value heads (Nq must be a multiple of Nkv)"))
    if found:
        raise refuse_all(found)


def segment_chunks(num_segments: int, limit: int = NPU_MAX_SEGMENTS) -> list[tuple[int, int]]:
    """``[first, stop)`` segment ranges of at most ``limit`` segments covering all of them."""
    return [(a, min(a + limit, num_segments)) for a in range(0, num_segments, limit)]


@functools.lru_cache(maxsize=None)
def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``2.2.0+cu12`` (numbers, not strings,
    are compared)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise refuse("kernels.te_release",
                     f"cannot read the transformer-engine version {version!r}")

    return int(match.group(1)), int(match.group(2))
