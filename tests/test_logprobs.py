"""token_log_probs: the plain per-sequence log-probs and entropy, read from flat logits in
bounded memory, over the whole vocabulary or a vocabulary split into shards."""

import threading
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from prefix_sharing import PrefixSharingConfig, build_plan, logprobs
from prefix_sharing.equivalence import plain_token_log_probs
from prefix_sharing.logprobs import token_log_probs
from tests.script_modules import load_script
from tests.strategies import forests

VOCAB = 11
SHARE_EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
# a shared prompt, a duplicate, a strict prefix, targets in every part of the vocabulary, a pad row
SEQS = [[1, 2, 3, 4, 9], [1, 2, 3, 7, 10, 0], [1, 2, 3, 4, 9], [1, 2], [5, 6, 8]]
LOSSES = {"log_probs": (1.0, 0.0), "entropy": (0.0, 1.0), "both": (1.0, 1.0)}


def flat_logits(plan, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(plan.num_tokens_flat, VOCAB, generator=g, dtype=torch.float64) * 3
    return logits.to(dtype)


def weighted_sum(log_probs, entropy, used, seed=1):
    """``sum(w * log_probs) [+ sum(v * entropy)]``: every output that ``used`` names gets a
    gradient, the other none."""
    g = torch.Generator().manual_seed(seed)
    w_lp, w_ent = (torch.rand(log_probs.numel(), generator=g, dtype=torch.float64) * s
                   for s in LOSSES[used])
    loss = (w_lp.to(log_probs.dtype) * log_probs).sum()
    return loss + (w_ent.to(entropy.dtype) * entropy).sum() if LOSSES[used][1] else loss


@contextmanager
def chunks_of(rows: int):
    with mock.patch.object(logprobs, "CHUNK_ELEMENTS", rows * VOCAB):
        yield


def plain(flat, plan, temperature=1.0):
    """The reference: every sequence's own rows, restored, through ``log_softmax``."""
    return plain_token_log_probs(plan.restore(flat) / temperature, plan.split(plan.token_ids))


# ------------------------------------------------------------------- whole vocabulary
@settings(deadline=None)
@given(forests(), st.sampled_from([1, 2, 1000]), st.sampled_from(list(LOSSES)))
def test_equal_to_plain_log_probs_of_the_restored_logits(seqs, chunk_rows, used):
    plan = build_plan(seqs, SHARE_EVERY_PREFIX, pad_to_multiple_of=3)
    flat = flat_logits(plan).requires_grad_()
    with chunks_of(chunk_rows):
        stats = token_log_probs(flat, plan)
        got = torch.autograd.grad(weighted_sum(*stats, used), flat)[0]
    ref_lp, ref_ent = plain(flat, plan)
    want = torch.autograd.grad(weighted_sum(ref_lp, ref_ent, used), flat)[0]
    torch.testing.assert_close(stats.log_probs, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.entropy, ref_ent, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_last_positions_score_nothing_and_pad_rows_get_no_gradient():
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    assert plan.num_padding > 0
    flat = flat_logits(plan).requires_grad_()
    stats = token_log_probs(flat, plan)
    weighted_sum(*stats, "both").backward()
    assert stats.log_probs[plan.is_last_token].eq(0).all()
    assert flat.grad[plan.num_tokens_flat - plan.num_padding:].eq(0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_pass_gradcheck_in_float64(temperature):
    """Each output alone and both together (gradcheck takes one output at a time, then all)."""
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    flat = flat_logits(plan, dtype=torch.float64).requires_grad_()
    with chunks_of(3):
        assert torch.autograd.gradcheck(
            lambda x: tuple(token_log_probs(x, plan, temperature=temperature)), flat)
        assert torch.autograd.gradcheck(
            lambda x: token_log_probs(x, plan, temperature=temperature, with_entropy=False)[0],
            flat)
    stats = token_log_probs(flat, plan, temperature=temperature)
    assert stats.log_probs.dtype == stats.entropy.dtype == torch.float64


@pytest.mark.parametrize("temperature", [2.0, 0.7])
def test_temperature_divides_the_logits(temperature):
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX)
    flat = flat_logits(plan).requires_grad_()
    with chunks_of(2):
        hot = token_log_probs(flat, plan, temperature=temperature)
        got = torch.autograd.grad(weighted_sum(*hot, "both"), flat)[0]
    ref_lp, ref_ent = plain(flat, plan, temperature)
    torch.testing.assert_close(hot.log_probs, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hot.entropy, ref_ent, rtol=1e-6, atol=1e-6)
    want = torch.autograd.grad(weighted_sum(ref_lp, ref_ent, "both"), flat)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_without_entropy_the_log_probs_and_their_gradient_are_unchanged():
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX)
    flat = flat_logits(plan).requires_grad_()
    alone = token_log_probs(flat, plan, with_entropy=False)
    both = token_log_probs(flat, plan)
    assert alone.entropy is None
    assert torch.equal(alone.log_probs, both.log_probs)
    assert torch.equal(torch.autograd.grad(weighted_sum(*alone, "log_probs"), flat)[0],
                       torch.autograd.grad(weighted_sum(*both, "log_probs"), flat)[0])


def test_bf16_logits_are_computed_in_fp32_and_get_a_bf16_gradient_rounded_once():
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX)
    low = flat_logits(plan, dtype=torch.bfloat16).requires_grad_()
    upcast = low.detach().float().requires_grad_()
    with chunks_of(2):
        stats_low, stats_up = token_log_probs(low, plan), token_log_probs(upcast, plan)
        weighted_sum(*stats_low, "both").backward()
        weighted_sum(*stats_up, "both").backward()
    assert stats_low.log_probs.dtype == torch.float32
    assert torch.equal(stats_low.log_probs, stats_up.log_probs)
    assert torch.equal(stats_low.entropy, stats_up.entropy)
    assert low.grad.dtype == torch.bfloat16
    assert torch.equal(low.grad, upcast.grad.bfloat16())


class _Shapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_never_builds_logits_for_every_token():
    base = [i % VOCAB for i in range(1, 30)]
    plan = build_plan([base + [1], base + [2], base + [3]])
    flat = flat_logits(plan).requires_grad_()
    with _Shapes() as seen:
        stats = token_log_probs(flat, plan)
        (stats.log_probs.sum() + stats.entropy.sum()).backward()
    assert (plan.num_tokens_flat, VOCAB) in seen.shapes  # the flat rows are normalised...
    assert all(s[0] != plan.num_tokens_total for s in seen.shapes if len(s) == 2)  # ...only


def test_refuses_logits_of_another_layout():
    plan = build_plan([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"flat_logits must be \(T_flat=3, vocab\); got \(4, 11\)"):
        token_log_probs(torch.zeros(4, 11), plan)


def test_refuses_a_temperature_that_is_not_positive():
    plan = build_plan([[1, 2, 3]])
    with pytest.raises(ValueError, match="temperature must be positive; got 0"):
        token_log_probs(torch.zeros(3, 11), plan, temperature=0)


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_beyond_the_logits_is_their_gradient_and_two_chunks(dtype):
    """Nothing of the logits' size is held for the backward; the peak is the gradient itself
    plus two fp32 chunks of rows (and a few per-token vectors)."""
    bench = load_script("bench_logprob_memory")
    tokens, vocab, chunk_rows = 256, 4096, 8
    plan = bench.grpo_plan(tokens, vocab)
    with mock.patch.object(logprobs, "CHUNK_ELEMENTS", chunk_rows * vocab):
        peak = bench.measure(token_log_probs, plan, vocab, dtype)
    gradient = plan.num_tokens_flat * vocab * dtype.itemsize
    chunk = chunk_rows * vocab * 4
    vectors = 8 * 8 * (plan.num_tokens_flat + plan.num_tokens_total)  # 8 int64 vectors
    assert vectors < chunk / 2  # so that a third chunk would not fit in the bounds below
    assert peak["held"] <= vectors
    assert peak["forward"] <= 2 * chunk + vectors
    assert peak["total"] <= gradient + 2 * chunk + vectors
    assert peak["total"] >= gradient  # the accounting sees the gradient


# ------------------------------------------------------------------- split vocabulary
class _Exchange:
    """In-process all-reduce for shards that run in threads: each deposits, all combine."""

    def __init__(self, shards: int) -> None:
        self.barrier = threading.Barrier(shards, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * shards

    def reduce(self, rank, x, combine):
        self.slots[rank] = x.clone()
        self.barrier.wait()
        out = combine(torch.stack(self.slots))
        self.barrier.wait()  # every shard has read the slots before they are reused
        return out


class _ThreadShard:
    """A :class:`~prefix_sharing.logprobs.VocabShard` over an :class:`_Exchange`; it records
    the reductions it is asked for."""

    def __init__(self, exchange: _Exchange, rank: int, vocab_start: int) -> None:
        self.exchange, self.rank, self.vocab_start = exchange, rank, vocab_start
        self.calls: list[str] = []

    def sum(self, x):
        self.calls.append("sum")
        return self.exchange.reduce(self.rank, x, lambda s: s.sum(0))

    def max(self, x):
        self.calls.append("max")
        return self.exchange.reduce(self.rank, x, lambda s: s.amax(0))


def split_run(flat, plan, bounds, used, **kwargs):
    """Each vocabulary slice ``[a, b)`` in its own thread, as a tensor-parallel rank would run
    it; returns each shard's stats, the slices' gradients put back together, and each shard's
    reductions in the forward and in the backward."""
    def rank_main(shard, start, stop):
        local = flat.detach()[:, start:stop].clone().requires_grad_()
        stats = token_log_probs(local, plan, vocab_shard=shard, **kwargs)
        forward_calls = list(shard.calls)
        grad = torch.autograd.grad(weighted_sum(*stats, used), local)[0]
        return stats, grad, (forward_calls, shard.calls[len(forward_calls):])

    stats, grads, calls = zip(*run_shards(bounds, rank_main))
    return stats, torch.cat(grads, dim=1), calls


def run_shards(bounds, rank_main) -> list:
    """``rank_main(shard, start, stop)`` for each vocabulary slice ``[start, stop)`` in its own
    thread, each with a :class:`_ThreadShard` over one exchange; their results in rank order
    (the first error raised here)."""
    exchange = _Exchange(len(bounds))
    results: list = [None] * len(bounds)

    def run(rank, start, stop):
        try:
            results[rank] = rank_main(_ThreadShard(exchange, rank, start), start, stop)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            exchange.barrier.abort()
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank, start, stop))
               for rank, (start, stop) in enumerate(bounds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("bounds", [[(0, 6), (6, 11)], [(0, 3), (3, 4), (4, 11)]])
@pytest.mark.parametrize("temperature,with_entropy,used", [
    (1.0, True, "both"),
    (0.7, True, "entropy"),
    (0.7, True, "log_probs"),
    (2.0, False, "log_probs"),
])
def test_a_split_vocabulary_gives_the_whole_vocabulary_results(bounds, temperature, with_entropy,
                                                                 used):
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    flat = flat_logits(plan).requires_grad_()
    kwargs = dict(temperature=temperature, with_entropy=with_entropy)
    with chunks_of(3):
        shards, got, calls = split_run(flat, plan, bounds, used, **kwargs)
        whole = token_log_probs(flat, plan, **kwargs)
        want = torch.autograd.grad(weighted_sum(*whole, used), flat)[0]
    for stats in shards:
        torch.testing.assert_close(stats.log_probs, whole.log_probs, rtol=1e-6, atol=1e-6)
        if with_entropy:
            torch.testing.assert_close(stats.entropy, whole.entropy, rtol=1e-6, atol=1e-6)
        else:
            assert stats.entropy is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a shift and one sum of all the per-row and per-token statistics; the backward needs none
    assert all(c == (["max", "sum"], []) for c in calls), calls


# ------------------------------------------------------------------- independent reference
class _TokenPositionModel:
    """A causal toy model: the logits of a token are its embedding plus its position's.

    Each flat row stands for the same (token, position) in every sequence that reads it, so
    the plan's layout gives the same logits as the input sequences do. The reference below
    runs on the input sequences alone - no plan, no restore, none of this package's code - and
    the gradients are compared on the model's weights.
    """

    def __init__(self, max_len: int = 16, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.embed = (torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * 3).requires_grad_()
        self.pos = torch.randn(max_len, VOCAB, generator=g, dtype=torch.float64).requires_grad_()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens] + self.pos[positions]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed, self.pos


def reference_from_sequences(model, seqs, temperature):
    """Per input sequence: logits / T, log-softmax, the next token's log-prob (0 at the last
    position, which predicts nothing) and the entropy; concatenated in sequence order."""
    log_probs, entropy = [], []
    for seq in map(torch.tensor, seqs):
        logp = torch.log_softmax(model(seq, torch.arange(len(seq))) / temperature, dim=-1)
        picked = logp[torch.arange(len(seq) - 1), seq[1:]]
        log_probs.append(torch.cat([picked, picked.new_zeros(1)]))
        entropy.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(log_probs), torch.cat(entropy)


def _grads(model, log_probs, entropy, used):
    return torch.autograd.grad(weighted_sum(log_probs, entropy, used), model.weights())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("used", list(LOSSES))
def test_equal_to_the_input_sequences_run_plainly(temperature, used):
    model = _TokenPositionModel()
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    assert plan.num_tokens_unique < plan.num_tokens_total  # something is shared
    with chunks_of(3):
        stats = token_log_probs(model(plan.input_ids, plan.position_ids), plan,
                                temperature=temperature)
        got = _grads(model, stats.log_probs, stats.entropy, used)
    ref_lp, ref_ent = reference_from_sequences(model, SEQS, temperature)
    torch.testing.assert_close(stats.log_probs, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.entropy, ref_ent, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, _grads(model, ref_lp, ref_ent, used), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_independent_reference_sees_a_dropped_temperature():
    """The check has the power to fail: log-probs at T=1 are not those at T=0.7."""
    model = _TokenPositionModel()
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX)
    stats = token_log_probs(model(plan.input_ids, plan.position_ids), plan)
    ref_lp, _ = reference_from_sequences(model, SEQS, 0.7)
    assert (stats.log_probs - ref_lp).abs().max() > 0.1


@pytest.mark.parametrize("bounds", [[(0, 6), (6, 11)], [(0, 3), (3, 4), (4, 11)]])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_split_vocabulary_equals_the_input_sequences_run_plainly(bounds, temperature):
    model = _TokenPositionModel()
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    flat = model(plan.input_ids, plan.position_ids)
    with chunks_of(3):
        shards, got, _ = split_run(flat, plan, bounds, "both", temperature=temperature)
    ref_lp, ref_ent = reference_from_sequences(model, SEQS, temperature)
    for stats in shards:
        torch.testing.assert_close(stats.log_probs, ref_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(stats.entropy, ref_ent, rtol=1e-12, atol=1e-12)
    # the flat logits' gradient, carried to the weights, is the reference's
    got_weights = torch.autograd.grad(flat, model.weights(), got)
    for g, w in zip(got_weights, _grads(model, ref_lp, ref_ent, "both"), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
