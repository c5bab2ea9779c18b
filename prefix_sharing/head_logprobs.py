"""Log-probs and entropy straight from hidden states and the LM head, in chunks of rows.

:func:`~prefix_sharing.logprobs.token_log_probs` starts from logits, which the model has
already built: ``(T_flat, vocab)``, tens of GB per rank at 128k tokens and a 150k-250k
vocabulary. Here the LM head itself runs inside the scoring, one chunk of rows at a time, in
the forward and again in the backward (:class:`_LinearTokenStats` recomputes each chunk's
logits from the saved hidden states and weight). No tensor with a vocabulary dimension is ever
larger than one chunk, ``(chunk_rows, vocab)``; what the backward keeps is the hidden rows
(which the model keeps anyway) and a few per-row vectors.

And only the rows that are read are scored. A packed position ``(r, t)`` reads the flat row
``plan.kv_index[(r, t)]``; verl reads positions ``[len - response - 1, len - 1)`` of each
sample, so the rows of the prompt positions before them are never multiplied by the head.
Several positions may read one flat row (a provider's last prefix row predicts each reuser's
first own token): the row is scored once, and each reader picks its own target from it.

Two layers, as flash-attn separates its kernel from its varlen wrapper:

- :func:`linear_log_probs`: the kernel, framework-free: hidden rows, head weight (+ bias),
  ``(reader row, target)`` pairs in; one log-prob per pair and one entropy per row out.
- :func:`hidden_token_stats`: the plan-level call: the flat hidden states of a
  :class:`~prefix_sharing.plan.SharingPlan` in, per-(sequence, position)
  :class:`~prefix_sharing.logprobs.TokenStats` out, the read window only.

A vocabulary split across ranks (Megatron's vocab-parallel head) plugs in as a
:class:`~prefix_sharing.logprobs.VocabShard`, the same step :func:`token_log_probs` takes: each
rank's forward reduces per-row statistics (a max, then one sum) over the shards; its backward
gives this rank's share of the hidden states' gradient, which the caller's tensor-parallel
region sums (as Megatron's column-parallel head does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .logprobs import CHUNK_ELEMENTS, TokenStats, VocabShard, _WholeVocab, shifted_logit_grad
from .plan import SharingPlan

__all__ = ["hidden_token_stats", "linear_log_probs", "read_positions"]


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    readers: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_rows: int | None = None,
    vocab_shard: VocabShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and per-row entropy of ``softmax((hidden @ weight.T + bias) / T)``.

    With ``z = (hidden @ weight.T + bias) / temperature`` (one row of logits per hidden row)::

        log_probs[i] = z[readers[i], targets[i]] - logsumexp(z[readers[i]])
        entropy[r]   = logsumexp(z[r]) - sum_v softmax(z[r])_v * z[r, v]

    computed ``chunk_rows`` rows at a time in the forward and the backward: no
    ``(rows, vocab)`` tensor exists, only ``(chunk_rows, vocab)`` ones (the logits in the
    weight's dtype, then fp32). Differentiable in ``hidden``, ``weight`` and ``bias`` through
    both outputs; a row read by several pairs gets the sum of their gradients. Under
    ``torch.autocast`` the head's matmul runs in the autocast dtype, in the backward too.

    Args:
        hidden: ``(rows, hidden_size)`` the rows to score (any float dtype).
        weight: ``(vocab, hidden_size)`` the LM head's weight (tied embeddings: the embedding
            matrix); with ``vocab_shard``, this rank's ``(V_local, hidden_size)`` slice.
        readers: ``(P,)`` int64 in ``[0, rows)``: the row each pair is scored at. A row may
            appear in several pairs, or in none (it then has an entropy only).
        targets: ``(P,)`` int64 token ids (of the whole vocabulary) the pairs score.
        bias: ``(vocab,)`` (or ``(V_local,)``) the head's bias, or ``None``.
        temperature: the logits are divided by it (verl's sampling temperature); positive.
        with_entropy: also return the entropy.
        chunk_rows: rows per chunk; default ``CHUNK_ELEMENTS // vocab`` (64 MiB of fp32 logits).
        vocab_shard: the reductions over a vocabulary split across ranks; ``None``: ``weight``
            holds the whole vocabulary.

    Returns:
        ``(log_probs, entropy)``: ``(P,)`` and ``(rows,)`` (``None`` without ``with_entropy``),
        fp32 (float64 for float64 inputs).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"hidden must be (rows, hidden_size) and weight (vocab, hidden_size); "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if readers.shape != targets.shape or readers.dim() != 1:
        raise ValueError(f"readers and targets must be (P,); got {tuple(readers.shape)} and "
                         f"{tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive; got {temperature}")
    shard = _WholeVocab() if vocab_shard is None else vocab_shard
    vocab_local = weight.size(0)
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS // max(1, vocab_local))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1; got {chunk_rows}")
    local = targets - shard.vocab_start  # column in this shard
    picks = (local >= 0) & (local < vocab_local)
    return _LinearTokenStats.apply(hidden, weight, bias, readers, local.clamp(0, vocab_local - 1),
                                   picks, float(temperature), with_entropy, int(chunk_rows), shard)


class _LinearTokenStats(torch.autograd.Function):
    """:func:`linear_log_probs` with an analytic, chunk-recomputing backward.

    Per row, with ``p = softmax(z)`` and ``E = E_p[z]``, the upstream gradients summed over the
    row's readers (``g_lp``; ``g_ent`` its entropy's)::

        d/dz = onehot terms (one per reader, its g_lp at its target) - p * (g_lp + g_ent * (z - E))

    then ``d/dlogits = (d/dz) / T``, ``d hidden = d/dlogits @ weight``,
    ``d weight = d/dlogits^T @ hidden`` (accumulated over chunks in fp32), ``d bias`` its row
    sums. The backward itself is not differentiable (a second derivative raises).
    """

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, readers, targets, picks, temperature,
                with_entropy, chunk_rows, shard):
        ctx.set_materialize_grads(False)
        compute = torch.promote_types(hidden.dtype, torch.float32)
        rows = hidden.size(0)
        row_max = hidden.new_empty(rows, dtype=compute)  # [R] each row's max logit (local)
        # [2, R]: sum e^(z - max) and sum e^(z - max) (z - max) per row
        sums = hidden.new_zeros((2, rows), dtype=compute)
        picked = hidden.new_zeros(readers.shape, dtype=compute)  # [P] z[target] - max
        for start, stop in _chunks(rows, chunk_rows):
            z = _logits(hidden, weight, bias, start, stop, compute, temperature)  # [c, V_local]
            row_max[start:stop] = z.amax(dim=-1)
            z.sub_(row_max[start:stop, None])
            picked += _picked(z, readers, targets, start, stop)
            e = z.exp()
            sums[0, start:stop] = e.sum(dim=-1)
            if with_entropy:
                sums[1, start:stop] = e.mul_(z).sum(dim=-1)
            del z, e
        # shift every row to the max over the shards, then one sum for all three statistics
        shift = shard.max(row_max)
        scale = (row_max - shift).exp()
        sums[1].add_(sums[0] * (row_max - shift)).mul_(scale)
        sums[0].mul_(scale)
        picked = (picked + (row_max - shift)[readers]) * picks
        reduced = shard.sum(torch.cat([sums.flatten(), picked]))
        denominator, expected = reduced[:rows], reduced[rows:2 * rows] / reduced[:rows]
        log_denominator = denominator.log()  # lse = shift + log_denominator
        log_probs = reduced[2 * rows:] - log_denominator[readers]
        entropy = log_denominator - expected if with_entropy else None  # H = lse - E[z]
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.save_for_backward(hidden, weight, bias, readers, targets, picks, shift,
                              log_denominator, expected)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_log_probs, grad_entropy):
        (hidden, weight, bias, readers, targets, picks, shift, log_denominator,
         expected) = ctx.saved_tensors
        nothing = (None,) * 10
        if grad_log_probs is None and grad_entropy is None:
            return nothing
        compute, rows, temperature = shift.dtype, hidden.size(0), ctx.temperature
        row_lp = picked_grad = row_ent = None
        if grad_log_probs is not None:  # per row: its readers' summed upstream gradient
            grad_log_probs = grad_log_probs.to(compute)
            row_lp = shift.new_zeros(rows).index_add_(0, readers, grad_log_probs)
            picked_grad = grad_log_probs.masked_fill(~picks, 0.0)
        if grad_entropy is not None:
            row_ent = grad_entropy.to(compute)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=compute, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        grad_bias = (torch.zeros(bias.shape, dtype=compute, device=bias.device)
                     if bias is not None and ctx.needs_input_grad[2] else None)

        with torch.autocast(**ctx.autocast):
            matmul = _logits_dtype(hidden, weight)
        weight_mm = weight.to(matmul)
        for start, stop in _chunks(rows, ctx.chunk_rows):
            with torch.autocast(**ctx.autocast):  # the forward's logits again
                z = _logits(hidden, weight, bias, start, stop, compute, temperature)
            dlogits = shifted_logit_grad(  # [c, V_local]
                z.sub_(shift[start:stop, None]), start, log_denominator, expected, row_lp,
                row_ent, readers, targets, picked_grad, temperature).to(matmul)
            del z
            if grad_hidden is not None:
                grad_hidden[start:stop] = dlogits @ weight_mm
            if grad_weight is not None:
                grad_weight.add_(dlogits.t() @ hidden[start:stop].to(matmul))
            if grad_bias is not None:
                grad_bias.add_(dlogits.sum(dim=0))
            del dlogits
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return (grad_hidden, grad_weight, grad_bias) + nothing[3:]


def _chunks(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_rows, rows)) for s in range(0, rows, chunk_rows)]


def _picked(z: torch.Tensor, readers: torch.Tensor, targets: torch.Tensor, start: int,
            stop: int) -> torch.Tensor:
    """``(P,)``: ``z[reader - start, target]`` for the readers of rows ``[start, stop)``, else 0."""
    local = readers - start
    inside = (local >= 0) & (local < stop - start)
    return z[local.clamp(0, stop - start - 1), targets].masked_fill(~inside, 0.0)


def _logits(hidden, weight, bias, start, stop, compute, temperature) -> torch.Tensor:
    """``(hidden[start:stop] @ weight.T + bias) / temperature``, a fresh fp32 (or float64)
    ``(stop - start, V_local)`` chunk; the matmul in the weight's (or autocast's) dtype, as the
    model's own head would run it."""
    z = F.linear(hidden[start:stop], weight, bias).to(compute)
    return z.div_(temperature) if temperature != 1.0 else z


def _logits_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here (autocast's, when it is on)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _autocast_state(device: str) -> dict[str, Any]:
    """The autocast settings in force now, to enter again in the backward."""
    return {"device_type": device, "enabled": torch.is_autocast_enabled(device),
            "dtype": torch.get_autocast_dtype(device)}


def read_positions(plan: SharingPlan, read_from: Sequence[int] | None = None) -> torch.Tensor:
    """``(P,)`` int64 packed positions (``kv_index`` order) of ``[read_from[r], len_r)`` of every
    sequence ``r``; every position when ``read_from`` is ``None``.

    verl reads positions ``[len - response - 1, len - 1)``: ``read_from = prompt_len - 1``. The
    last position (``len - 1``) is kept too, so that each sequence's entropy covers the same
    span as :func:`~prefix_sharing.logprobs.token_log_probs`'; it predicts nothing and is
    scored 0, and it costs at most one row per sequence.
    """
    device = plan.kv_index.device
    if read_from is None:
        return torch.arange(plan.num_tokens_total, device=device)
    if len(read_from) != plan.num_sequences:
        raise ValueError(f"{len(read_from)} read starts for {plan.num_sequences} sequences")
    bad = [i for i, (s, n) in enumerate(zip(read_from, plan.seq_lens)) if not 0 <= s < n]
    if bad:
        i = bad[0]
        raise ValueError(f"sequence {i} has {plan.seq_lens[i]} tokens; reading cannot start at "
                         f"{read_from[i]} (needs 0 <= start < length)")
    starts, offset = [], 0  # host ints from the host-side lengths: no read back
    for s, n in zip(read_from, plan.seq_lens):
        starts.append(torch.arange(offset + s, offset + n))
        offset += n
    return torch.cat(starts).to(device)


def hidden_token_stats(
    flat_hidden: torch.Tensor,
    weight: torch.Tensor,
    plan: SharingPlan,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    read_from: Sequence[int] | None = None,
    chunk_rows: int | None = None,
    vocab_shard: VocabShard | None = None,
) -> TokenStats:
    """Per-(sequence, position) log-probs and entropy from the flat hidden states of ``plan``.

    The read positions (:func:`read_positions`) are mapped through ``plan.kv_index`` to their
    flat rows; each distinct row is gathered once (``(U, hidden_size)``) and scored by
    :func:`linear_log_probs`, every position picking its own next token. Positions outside
    the read window get 0 (log-prob and entropy) and no gradient; so do last positions' log-probs.

    Args:
        flat_hidden: ``(T_flat, hidden_size)`` the model's last hidden states (after its final
            norm) on the plan's flat layout.
        weight, bias: the LM head (``(vocab, hidden_size)``, ``(vocab,)`` or ``None``), as in
            :func:`linear_log_probs`.
        plan: the plan ``flat_hidden`` was computed with (on its device).
        temperature, with_entropy, chunk_rows, vocab_shard: as in :func:`linear_log_probs`.
        read_from: per sequence (plan order), the first position read; ``None``: all.

    Returns:
        :class:`~prefix_sharing.logprobs.TokenStats` of ``(T_total,)`` tensors, packed per
        sequence in the plan's order, the value at ``t`` scoring token ``t + 1``.
    """
    if flat_hidden.dim() != 2 or flat_hidden.size(0) != plan.num_tokens_flat:
        raise ValueError(f"flat_hidden must be (T_flat={plan.num_tokens_flat}, hidden_size); "
                         f"got {tuple(flat_hidden.shape)}")
    positions = read_positions(plan, read_from)  # [P]
    rows, reader = torch.unique(plan.kv_index.index_select(0, positions), sorted=True,
                                return_inverse=True)  # [U] distinct flat rows, [P] into them
    scored = ~plan.is_last_token.index_select(0, positions)
    log_probs, entropy = linear_log_probs(
        flat_hidden.index_select(0, rows), weight, reader[scored],
        plan.next_token_ids.index_select(0, positions)[scored], bias=bias,
        temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows,
        vocab_shard=vocab_shard)
    zeros = log_probs.new_zeros(plan.num_tokens_total)
    log_probs = zeros.index_copy(0, positions[scored], log_probs)
    if entropy is not None:
        entropy = zeros.index_copy(0, positions, entropy.index_select(0, reader))
    return TokenStats(log_probs, entropy)
