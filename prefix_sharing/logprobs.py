"""Per-token log-probs and entropy straight from the flat logits, in bounded memory.

The flat logits hold one row per *computed* token. Every packed position ``(r, t)`` reads its
row through ``plan.kv_index``; a row that several sequences share is normalised once and then
gathered at each sequence's own next token. Nothing of size ``(T_total, vocab)`` is built.

Memory. Traced by autograd, the softmax arithmetic keeps two fp32 ``(T_flat, vocab)`` tensors
for the backward and peaks at five (``scripts/bench_logprob_memory.py``): about 50 GB for 16k
tokens of a 150k vocabulary. Instead one autograd function walks the rows in chunks of at most
:data:`CHUNK_ELEMENTS` logits, keeps only per-row statistics (shift, log-denominator, expected
logit) and, in the backward, recomputes each chunk's softmax and writes its gradient straight
into the result. Beyond the logits and their gradient, the working set is two fp32 chunks and a
few ``(T_flat,)`` / ``(T_total,)`` vectors, whatever the logits' dtype (bf16 logits are
upcast one chunk at a time).

Under tensor parallelism the vocabulary is split across ranks. The forward then needs two
reductions over the shards (a max to shift by, and one sum of the per-row denominators,
expected logits and picked target logits); they come from a :class:`VocabShard`, so this module
stays free of ``torch.distributed`` (``prefix_sharing.megatron_ext`` supplies Megatron's). The
backward needs none: with the reduced statistics each rank's softmax slice is known locally.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch.autograd.function import once_differentiable

from .plan import SharingPlan

__all__ = ["CHUNK_ELEMENTS", "TokenStats", "VocabShard", "token_log_probs"]

CHUNK_ELEMENTS = 1 << 24
"""Logits per chunk of rows (64 MiB in fp32): big enough to keep a GPU busy, small beside a
``(T_flat, vocab)`` buffer. A chunk has at least one row."""


class TokenStats(NamedTuple):
    """``(T_total,)`` tensors, packed per sequence in the plan's order; fp32 (float64 for
    float64 logits).

    ``log_probs[(r, t)] = log p(x[r, t+1] | x[r, :t+1])`` (0 at each sequence's last position,
    which predicts nothing); ``entropy[(r, t)]`` is the entropy of that next-token distribution.
    This is the layout verl and Megatron use (value at ``t`` scores token ``t + 1``).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class VocabShard(Protocol):
    """This rank's slice ``[vocab_start, vocab_start + V_local)`` of a vocabulary split by rank.

    Both reductions are called once per forward, outside autograd, on every rank in the same
    order; they return a new tensor and leave ``x`` as it was.
    """

    vocab_start: int

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over the shards."""

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max over the shards."""


class _WholeVocab:
    vocab_start = 0

    @staticmethod
    def sum(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def max(x: torch.Tensor) -> torch.Tensor:
        return x


def token_log_probs(
    flat_logits: torch.Tensor,
    plan: SharingPlan,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_shard: VocabShard | None = None,
    positions: torch.Tensor | None = None,
    row_start: int = 0,
    targets: torch.Tensor | None = None,
) -> TokenStats:
    """Log-probs (and entropy) of every sequence's tokens from ``(T_flat, vocab)`` logits.

    Differentiable in ``flat_logits`` through both outputs; the gradient of a row that several
    sequences read is the sum over its readers, and comes back in the logits' dtype.

    Args:
        flat_logits: ``(T_flat, vocab)`` logits of the plan's flat layout (any float dtype;
            computed in fp32, or float64 for float64 logits). With ``vocab_shard``: this rank's
            ``(T_flat, V_local)`` slice.
        plan: the plan the logits were computed with (on the logits' device).
        temperature: logits are divided by it first, as verl does for rollout parity.
        with_entropy: also return the entropy.
        vocab_shard: the reductions over a vocabulary split across ranks; ``None`` when
            ``flat_logits`` holds the whole vocabulary.
        positions: only these packed positions (int64, ``kv_index`` order), whose flat rows
            must all lie in ``flat_logits``: then ``flat_logits`` holds the flat rows
            ``row_start ..`` only (a context-parallel rank's slice), and the result has one
            entry per position.
        row_start: the plan row of ``flat_logits``' first row (with ``positions``).
        targets: ``(T_total,)`` the token each position's log-prob is of, instead of the next
            one (``plan.next_token_ids``): a multi-token-prediction depth's labels
            (:mod:`prefix_sharing.megatron_ext.mtp`). Each sequence's last position still
            scores 0.
    """
    rows_expected = plan.num_tokens_flat if positions is None else flat_logits.size(0)
    if flat_logits.dim() != 2 or flat_logits.size(0) != rows_expected:
        raise ValueError(
            f"flat_logits must be (T_flat={plan.num_tokens_flat}, vocab); "
            f"got {tuple(flat_logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive; got {temperature}")
    shard = _WholeVocab() if vocab_shard is None else vocab_shard
    vocab_local = flat_logits.size(-1)
    rows, is_last = plan.kv_index, plan.is_last_token
    next_ids = plan.next_token_ids if targets is None else targets
    if positions is not None:  # [P]: a slice's positions, rows counted from the slice
        rows = rows.index_select(0, positions) - row_start
        next_ids, is_last = next_ids.index_select(0, positions), is_last.index_select(0, positions)
    targets = next_ids - shard.vocab_start  # column in this shard
    picks = (targets >= 0) & (targets < vocab_local) & ~is_last
    log_probs, entropy = _TokenStatsFunction.apply(
        flat_logits, rows, targets.clamp(0, vocab_local - 1), picks, is_last,
        float(temperature), with_entropy, shard,
    )
    return TokenStats(log_probs, entropy)


class _TokenStatsFunction(torch.autograd.Function):
    """``(log_probs, entropy | None)`` of :func:`token_log_probs`, with an analytic backward.

    With ``z = logits / T``, ``p = softmax(z)`` and, per packed position, the flat row it reads
    and its target ``y``::

        log_prob = z[y] - lse(z)          d log_prob / dz = onehot(y) - p
        entropy  = lse(z) - E_p[z]        d entropy / dz  = -p * (z - E_p[z])

    and ``d/dlogits = (d/dz) / T``. Summed over a row's readers, the gradient of a row is
    ``onehot terms - p * (g_lp + g_ent * (z - E_p[z]))`` with ``g_lp`` / ``g_ent`` the summed
    upstream gradients of its readers (``g_lp`` without last positions, which predict nothing).
    The backward itself is not differentiable (a second derivative raises).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,  # [T_flat, V_local]
        rows: torch.Tensor,  # [T_total] flat row each position reads
        targets: torch.Tensor,  # [T_total] target column in this shard (clamped)
        picks: torch.Tensor,  # [T_total] the target is in this shard (and not a last position)
        is_last: torch.Tensor,  # [T_total]
        temperature: float,
        with_entropy: bool,
        shard: VocabShard,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.set_materialize_grads(False)
        compute = torch.promote_types(logits.dtype, torch.float32)
        # the max of the rounded quotients is the rounded quotient of the max: no fp32 copy
        shift = shard.max(logits.amax(dim=-1).to(compute) / temperature)  # [T_flat]
        sums = logits.new_empty((2 if with_entropy else 1, logits.size(0)), dtype=compute)
        for start, stop in _chunks(logits):
            sums[:, start:stop] = _exp_sums(_shifted(logits, start, stop, shift, temperature),
                                            with_entropy)
        picked = (logits[rows, targets].to(compute) / temperature - shift[rows]) * picks
        reduced = shard.sum(torch.cat([sums.flatten(), picked]))  # one reduction for all three
        denominator, picked = reduced[: logits.size(0)], reduced[sums.numel():]
        log_denominator = denominator.log()  # lse = shift + log_denominator
        log_probs = (picked - log_denominator[rows]).masked_fill(is_last, 0.0)
        entropy = expected = None
        if with_entropy:
            # H = lse - E[z] = log_denominator - E[z - shift]
            expected = reduced[logits.size(0): sums.numel()] / denominator
            entropy = (log_denominator - expected)[rows]
        ctx.temperature = temperature
        ctx.save_for_backward(logits, rows, targets, picks, is_last, shift, log_denominator,
                              expected)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, rows, targets, picks, is_last, shift, log_denominator, expected = ctx.saved_tensors
        temperature = ctx.temperature
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 8
        # per flat row: the summed upstream gradient of its readers (0 for unread pad rows)
        row_lp = row_ent = picked_grad = None
        if grad_log_probs is not None:
            row_lp = shift.new_zeros(shift.shape).index_add_(
                0, rows, grad_log_probs.to(shift.dtype).masked_fill(is_last, 0.0))
            picked_grad = grad_log_probs.to(shift.dtype).masked_fill(~picks, 0.0)
        if grad_entropy is not None:
            row_ent = shift.new_zeros(shift.shape).index_add_(0, rows, grad_entropy.to(shift.dtype))

        grad = torch.empty_like(logits)
        for start, stop in _chunks(logits):  # rounded once to the logits' dtype
            grad[start:stop] = shifted_logit_grad(
                _shifted(logits, start, stop, shift, temperature), start, log_denominator,
                expected, row_lp, row_ent, rows, targets, picked_grad, temperature)
        return (grad,) + (None,) * 7


def shifted_logit_grad(z: torch.Tensor, start: int, log_denominator: torch.Tensor,
                       expected: torch.Tensor | None, row_lp: torch.Tensor | None,
                       row_ent: torch.Tensor | None, readers: torch.Tensor,
                       targets: torch.Tensor, picked_grad: torch.Tensor | None,
                       temperature: float) -> torch.Tensor:
    """The gradient wrt the logits of the rows ``[start, start + len(z))``, built in ``z``'s
    buffer: ``(onehot terms - p * (g_lp + g_ent * (z - E[z]))) / T``.

    ``z``: ``(rows, V_local)`` logits / T minus each row's (global) shift, a fresh buffer;
    ``log_denominator``, ``expected``: per row, the forward's ``log sum exp(z)`` and ``E[z]``
    (shifted); ``row_lp`` / ``row_ent``: per row, its readers' summed upstream gradients
    (``None``: no gradient for that output); ``readers`` / ``targets`` / ``picked_grad``: each
    reader's row, its target column in this shard and its log-prob gradient (0 where the target
    is elsewhere). Shared by :func:`token_log_probs` and
    :func:`prefix_sharing.head_logprobs.linear_log_probs`.
    """
    stop = start + z.size(0)
    p = (z - log_denominator[start:stop, None]).exp_()
    if row_ent is None:
        factor = row_lp[start:stop, None]
    else:  # g_lp + g_ent * (z - E[z]), built in z's buffer
        factor = z.sub_(expected[start:stop, None]).mul_(row_ent[start:stop, None])
        if row_lp is not None:
            factor.add_(row_lp[start:stop, None])
    dz = p.mul_(factor).neg_()
    del z, factor
    if row_lp is not None:  # + onehot(target) per reader; others add 0 to a clamped cell
        local = readers - start
        inside = (local >= 0) & (local < stop - start)
        dz.index_put_((local.clamp(0, stop - start - 1), targets),
                      picked_grad.masked_fill(~inside, 0.0), accumulate=True)
    return dz.div_(temperature) if temperature != 1.0 else dz


def _chunks(logits: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges of at most :data:`CHUNK_ELEMENTS` logits each (at least one row)."""
    step = max(1, CHUNK_ELEMENTS // max(1, logits.size(-1)))
    return [(s, min(s + step, logits.size(0))) for s in range(0, logits.size(0), step)]


def _exp_sums(z: torch.Tensor, with_entropy: bool) -> torch.Tensor:
    """``(1 or 2, rows)``: ``sum(exp(z))`` per row, and ``sum(exp(z) * z)`` ``with_entropy``."""
    e = z.exp()
    denominator = e.sum(dim=-1)
    return torch.stack([denominator, e.mul_(z).sum(dim=-1)]) if with_entropy else denominator[None]


def _shifted(logits: torch.Tensor, start: int, stop: int, shift: torch.Tensor,
             temperature: float) -> torch.Tensor:
    """``logits[start:stop] / temperature - shift``, a fresh fp32 (or float64) chunk."""
    z = logits[start:stop].to(shift.dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z.sub_(shift[start:stop, None])
