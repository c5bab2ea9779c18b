"""CPU stand-ins for Transformer Engine's fused RoPE, as megatron-core calls it under
``apply_rope_fusion=True``, written from TE's documented semantics (not from megatron's unfused
code, so a test comparing the two checks one against the other).

TE's ``apply_rotary_pos_emb(t, freqs, tensor_format, fused=True, cu_seqlens=...)``:

- ``"sbhd"``: ``t`` is ``[s, b, heads, dim]``, ``freqs`` ``[>= s, 1, 1, rot]`` (fp32 angles);
  row ``i`` of ``t`` is rotated by the angles of ``freqs[i]``.
- ``"thd"``: ``t`` is ``[tokens, heads, dim]`` packed by ``cu_seqlens``; the ``j``-th token of
  each sequence is rotated by ``freqs[j]`` (positions restart at 0 in every sequence).

Either way the first ``rot`` channels rotate (non-interleaved: the two halves of the rotated
channels are the pair; interleaved: channels ``2k, 2k+1``), in fp32, and the rest pass
through; the result has ``t``'s dtype.

:func:`installed` swaps them into megatron's ``rope_utils`` (where ``apply_rotary_pos_emb``
looks them up, and ``TransformerConfig`` checks they exist) and counts the calls, so a test
can assert that the fused kernel, not megatron's unfused path, rotated the tokens.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator

import torch


def _rotate(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``t[..., :rot]`` rotated by ``angles`` (broadcast to it), the rest passed through."""
    rot = angles.size(-1)
    x, rest = t[..., :rot].float(), t[..., rot:]
    cos, sin = angles.float().cos(), angles.float().sin()
    if interleaved:  # pairs (2k, 2k+1) rotated by angle[2k] (= angle[2k+1])
        even, odd = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., 0::2], sin[..., 0::2]
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    else:  # the first half paired with the second
        first, second = x.chunk(2, dim=-1)
        rotated = x * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated.to(t.dtype), rest), dim=-1)


def fused_rope_sbhd(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                    interleaved: bool = False) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb`` (TE's ``tensor_format="sbhd"``)."""
    return _rotate(t, freqs[: t.size(0)], interleaved)


def fused_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                   cp_size: int = 1, cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb_thd`` (TE's ``tensor_format="thd"``; megatron-core
    0.19 passes ``interleaved``), one context-parallel rank only."""
    assert cp_size == 1, "the stand-in covers cp_size=1"
    bounds = cu_seqlens.tolist()
    offsets = torch.cat([torch.arange(end - start) for start, end in zip(bounds, bounds[1:])])
    return _rotate(t, freqs[offsets].squeeze(1), interleaved)


@contextlib.contextmanager
def installed() -> Iterator[collections.Counter]:
    """The stand-ins in megatron's ``rope_utils`` for the block; yields the call counts by
    tensor format (``"sbhd"``, ``"thd"``)."""
    from megatron.core.models.common.embeddings import rope_utils

    calls: collections.Counter = collections.Counter()

    def counted(name: str, kernel: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return call

    saved = rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd
    rope_utils.fused_apply_rotary_pos_emb = counted("sbhd", fused_rope_sbhd)
    rope_utils.fused_apply_rotary_pos_emb_thd = counted("thd", fused_rope_thd)
    try:
        yield calls
    finally:
        rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd = saved
