"""Attention over disjoint key sources, merged exactly by the log-sum-exp.

A query row's softmax over keys split into disjoint sources ``i`` is recovered from each
source's partial attention ``(o_i, lse_i)`` (``lse_i`` the natural log of the row's softmax
denominator over source ``i``'s keys)::

    lse = log sum_i exp(lse_i)          o = sum_i exp(lse_i - lse) o_i

flashinfer's ``merge_state`` (base 2 there; natural log here, as flash-attn's ``softmax_lse``).
An attention sink is one more source: ``lse_sink = sink``, ``o_sink = 0``.

The backward needs no gradient of any ``lse_i``: given the *merged* ``o`` and ``lse``, each
part's kernel backward computes its keys' weights ``exp(scale * q . k - lse)`` in the whole
softmax and the whole row's ``rowsum(do * o)``, so its ``dq``, ``dk``, ``dv`` are exactly its
share of the whole attention's (ring attention's identity). Every part reads K/V *in place*
(the flat rows, or a stored source: a cross-micro-batch prefix's K/V, :attr:`KeyPart.source`),
so ``dk`` and ``dv`` of each source are the sum of its parts' full-size gradients, added in
float32 in a fixed order and written once: no scatter, no atomics, the same bits every run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

__all__ = ["KeyPart", "SourceLayout", "attention_over_sources", "merge_states"]


@dataclasses.dataclass(frozen=True)
class KeyPart:
    """One kernel call: some query rows over segments of the in-place K/V.

    Attributes:
        q_index: ``(rows,)`` int64 rows of q this call's queries are, segment by segment;
            ``None``: every row of q in order.
        cu_seqlens_q, cu_seqlens_k: int32 boundaries (queries of this call, rows of K/V).
        cu_seqlens_q_host, cu_seqlens_k_host: the same as host ints.
        max_seqlen_q, max_seqlen_k: longest segments.
        causal: bottom-right causal (a segment's own keys) or every key (a shared node's
            keys, all of them earlier than every reader's queries).
        source: the K/V this call reads: 0 the in-place K/V (the flat rows), ``i > 0`` the
            ``i``-th stored source (:func:`attention_over_sources`' ``stored``).
        window: a causal call's sliding window, keys each query sees, itself included
            (``None``: all earlier keys).
        first_key: ``(rows,)`` int64, a non-causal call's first key of its segment each query
            row reads (keys before it are masked): a sliding window over a shared node, whose
            readers stack in one segment at different distances from it; ``None``: every key.
    """

    q_index: torch.Tensor | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    cu_seqlens_q_host: tuple[int, ...]
    cu_seqlens_k_host: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    source: int = 0
    window: int | None = None
    first_key: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class SourceLayout:
    """The kernel calls of one attention over sources and how their rows merge.

    Attributes:
        parts: ``parts[0]`` covers every query row in order (their own segments), and so does
            each following part without ``q_index`` (a stored source read by every row); each
            later part covers some rows again (their reads of shared nodes).
        slots: ``(T, D)`` int64: for each query row, the rows of ``cat(outputs of the parts
            after the whole ones)`` it merges, padded with that concatenation's length (an
            empty source: lse -inf); ``None`` without such parts.
    """

    parts: tuple[KeyPart, ...]
    slots: torch.Tensor | None = None

    @property
    def whole(self) -> int:
        """How many leading parts cover every query row in order (``q_index`` None)."""
        count = 0
        while count < len(self.parts) and self.parts[count].q_index is None:
            count += 1
        return count


# (forward, backward) of a backend's with-lse kernel: see torch_backend.attention_lse_torch
LseKernel = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]],
                  Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


def merge_states(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    slots: torch.Tensor | None,
    sinks: torch.Tensor | None,
    whole: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of partial attentions (module docstring), in float32 at least.

    Args:
        outs, lses: per part, ``(rows, h, dv)`` and ``(h, rows)``; ``outs[:whole]`` cover
            every query row in order, the others the rows ``slots`` names.
        slots: as :attr:`SourceLayout.slots`.
        sinks: ``(h,)`` sink logits, or ``None``.
        whole: as :attr:`SourceLayout.whole`.

    Returns:
        ``(out, lse)``: ``(T, h, dv)`` in ``outs[0]``'s dtype, ``(h, T)`` float32 (float64
        for float64 inputs). Computed in float32 for half inputs, float64 otherwise.
    """
    # one rounding of the merged output that a single kernel call does not have: computed in
    # twice the inputs' precision (float32 for half inputs, float64 for float32) it stays
    # below the kernels' own (the fp32 MLA/YaRN exactness check saw 1.1e-5 merged in fp32)
    compute = torch.float32 if outs[0].dtype in (torch.float16, torch.bfloat16) else torch.float64
    rows, heads, dim = outs[0].shape
    lse_columns = [lse.t().to(compute)[:, None] for lse in lses[:whole]]  # [T, 1, h] each
    out_columns = [out.to(compute)[:, None] for out in outs[:whole]]  # [T, 1, h, dv] each
    if len(outs) > whole:
        # one empty row at the end: the padding of ``slots``
        extra_lse = torch.cat([lse.t() for lse in lses[whole:]]
                              + [lses[0].new_full((1, heads), float("-inf"))]).to(compute)
        extra_out = torch.cat(outs[whole:] + [outs[0].new_zeros(1, heads, dim)]).to(compute)
        lse_columns.append(extra_lse[slots])  # [T, D, h]
        out_columns.append(extra_out[slots])  # [T, D, h, dv]
    if sinks is not None:
        lse_columns.append(sinks.to(compute).expand(rows, 1, heads))
    lse_all = torch.cat(lse_columns, 1)  # [T, P, h]
    lse = lse_all.logsumexp(1)  # [T, h]
    weights = (lse_all - lse[:, None]).exp()
    values = torch.cat(out_columns, 1)  # [T, P', h, dv] (a sink has no value)
    out = (weights[:, : values.size(1), :, None] * values).sum(1)
    lse_dtype = torch.promote_types(outs[0].dtype, torch.float32)
    return out.to(outs[0].dtype), lse.t().to(lse_dtype).contiguous()


class _AttentionOverSources(torch.autograd.Function):
    """Runs a :class:`SourceLayout`'s parts, merges them; the backward runs each part's
    kernel backward at the merged output and log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, kernel, softmax_scale, *stored):
        forward_kernel, _ = kernel
        keys, values = (k, *stored[0::2]), (v, *stored[1::2])
        outs, lses = [], []
        for part in layout.parts:
            rows = q if part.q_index is None else q.index_select(0, part.q_index)
            out, lse = forward_kernel(
                rows, keys[part.source], values[part.source], part.cu_seqlens_q,
                part.cu_seqlens_k, part.max_seqlen_q,
                part.max_seqlen_k, softmax_scale, causal=part.causal, window=part.window,
                first_key=part.first_key, cu_seqlens_q_host=part.cu_seqlens_q_host,
                cu_seqlens_k_host=part.cu_seqlens_k_host)
            outs.append(out)
            lses.append(lse)
        out, lse = merge_states(outs, lses, layout.slots, sinks, layout.whole)
        ctx.save_for_backward(q, out, lse, sinks, k, v, *stored)
        ctx.layout, ctx.kernel, ctx.scale = layout, kernel, softmax_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, sinks, *kv = ctx.saved_tensors
        keys, values = kv[0::2], kv[1::2]
        _, backward_kernel = ctx.kernel
        accumulate = torch.promote_types(q.dtype, torch.float32)
        dk = [torch.zeros(k.shape, dtype=accumulate, device=k.device) for k in keys]
        dv = [torch.zeros(v.shape, dtype=accumulate, device=v.device) for v in values]
        dq_parts = []
        for part in ctx.layout.parts:
            if part.q_index is None:
                rows = (dout, q, out, lse)
            else:
                rows = (dout.index_select(0, part.q_index), q.index_select(0, part.q_index),
                        out.index_select(0, part.q_index), lse.index_select(1, part.q_index))
            gq, gk, gv = backward_kernel(
                rows[0], rows[1], keys[part.source], values[part.source], rows[2], rows[3],
                part.cu_seqlens_q, part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k,
                ctx.scale, causal=part.causal, window=part.window, first_key=part.first_key,
                cu_seqlens_q_host=part.cu_seqlens_q_host,
                cu_seqlens_k_host=part.cu_seqlens_k_host)
            dq_parts.append(gq.to(accumulate))
            dk[part.source] += gk
            dv[part.source] += gv
        whole = ctx.layout.whole
        dq = dq_parts[0]
        for gq in dq_parts[1:whole]:  # every row's reads of the stored sources
            dq = dq + gq
        if len(dq_parts) > whole:  # each row's reads of shared nodes, summed in slot order
            extra = torch.cat(dq_parts[whole:] + [dq.new_zeros(1, *dq.shape[1:])])
            dq = dq + extra[ctx.layout.slots].sum(1)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d out / d sink = -exp(sink - lse) * out, per row and head
            lse_rows = lse.t().to(accumulate)  # [T, h]
            share = (sinks.to(accumulate)[None] - lse_rows).exp()
            dot = (dout.to(accumulate) * out.to(accumulate)).sum(-1)  # [T, h]
            dsinks = -(share * dot).sum(0).to(sinks.dtype)
        stored = []  # (dk_i, dv_i) of each stored source, as it was handed in
        for gk, gv, k, v in zip(dk[1:], dv[1:], keys[1:], values[1:]):
            stored += [gk.to(k.dtype), gv.to(v.dtype)]
        return (dq.to(q.dtype), dk[0].to(keys[0].dtype), dv[0].to(values[0].dtype), dsinks,
                None, None, None, *stored)


def attention_over_sources(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SourceLayout,
    kernel: LseKernel,
    softmax_scale: float | None = None,
    *,
    sinks: torch.Tensor | None = None,
    stored: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q's rows over the key sources ``layout`` names, merged exactly.

    Args:
        q: ``(T, nheads, headdim)``.
        k, v: ``(T_k, nheads_k, headdim[_v])``, read in place by the parts of source 0.
        layout: the kernel calls and their merge (:class:`SourceLayout`).
        kernel: the backend's ``(forward, backward)`` with-lse pair
            (:func:`~.backends.get_lse_kernel`).
        softmax_scale: defaults to ``headdim ** -0.5``.
        sinks: ``(nheads,)`` sink logits, merged as one more source; differentiable.
        stored: ``(k_i, v_i)`` of the stored sources ``i = 1, 2, ...`` (a cross-micro-batch
            store's K/V), read in place by the parts of source ``i``; differentiable.

    Returns:
        ``(out, lse)``: ``(T, nheads, headdim_v)`` differentiable in q, k, v, sinks and the
        stored K/V;
        ``(nheads, T)`` float32, the merged log-sum-exp (sink included), carrying no gradient
        (like flash-attn's).
    """
    if sinks is not None and sinks.shape != (q.size(1),):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q.size(1)},); "
                         f"got {tuple(sinks.shape)}")
    return _AttentionOverSources.apply(q, k, v, sinks, layout, kernel, softmax_scale,
                                       *(t for pair in stored for t in pair))
