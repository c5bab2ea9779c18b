"""hidden_token_stats / linear_log_probs: the LM head, log-softmax and entropy in chunks of
rows, scoring only the rows that are read, equal to the plain full-logits computation."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.equivalence import plain_token_log_probs
from prefix_sharing.head_logprobs import hidden_token_stats, linear_log_probs, read_positions
from tests.strategies import forests
from tests.test_logprobs import run_shards

VOCAB, HIDDEN = 11, 5
SHARE_EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
# a shared prompt, a duplicate, a strict prefix, a pad row
SEQS = [[1, 2, 3, 4, 9], [1, 2, 3, 7, 10, 0], [1, 2, 3, 4, 9], [1, 2], [5, 6, 8]]
GRPO = [[1, 2, 3, 4] + r for r in ([5, 6], [7, 8, 9], [10, 5], [0])]
UNSHARED = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


def head(plan, seed=0, bias=True, dtype=torch.float64):
    """Seeded flat hidden states ``(T_flat, HIDDEN)``, weight and bias, all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(plan.num_tokens_flat, HIDDEN, generator=g, dtype=dtype),
               torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype),
               torch.randn(VOCAB, generator=g, dtype=dtype) if bias else None]
    return [None if t is None else t.requires_grad_() for t in tensors]


def reference(hidden, weight, bias, plan, temperature, read_from):
    """Every sequence's full ``(len, vocab)`` logits through ``log_softmax``; 0 outside the
    read window (log-probs also at each last position)."""
    logits = plan.restore(F.linear(hidden, weight, bias)) / temperature  # [T_total, vocab]
    log_probs, entropy = plain_token_log_probs(logits, plan.split(plan.token_ids))
    read = torch.zeros(plan.num_tokens_total, dtype=torch.bool)
    read[read_positions(plan, read_from)] = True
    return log_probs * read, entropy * read


def loss(log_probs, entropy, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(2, log_probs.numel(), generator=g, dtype=log_probs.dtype)
    return (w[0] * log_probs).sum() + (w[1] * entropy).sum()


def check_against_reference(seqs, chunk_rows, read_from=None, temperature=1.0, bias=True,
                            pad=1):
    plan = build_plan(seqs, SHARE_EVERY_PREFIX, pad_to_multiple_of=pad)
    inputs = [t for t in head(plan, bias=bias) if t is not None]
    hidden, weight, b = head(plan, bias=bias)
    got = hidden_token_stats(hidden, weight, plan, bias=b, temperature=temperature,
                             read_from=read_from, chunk_rows=chunk_rows)
    want = reference(*inputs[:2], inputs[2] if bias else None, plan, temperature, read_from)
    torch.testing.assert_close(got.log_probs, want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.entropy, want[1], rtol=1e-10, atol=1e-10)
    grads_got = torch.autograd.grad(loss(*got), [t for t in (hidden, weight, b) if t is not None])
    grads_want = torch.autograd.grad(loss(*want), inputs)
    for g, w, name in zip(grads_got, grads_want, ("hidden", "weight", "bias")):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)


@settings(deadline=None, max_examples=25)
@given(forests(), st.sampled_from([1, 3, 1000]), st.data())
def test_equal_to_the_full_logits_on_any_forest_and_read_window(seqs, chunk_rows, data):
    """Chains, trees, duplicates, strict prefixes or nothing shared; chunks that do and do
    not divide the rows; any read window, or all positions."""
    read_from = data.draw(st.none() | st.tuples(*[st.integers(0, len(s) - 1) for s in seqs]))
    check_against_reference(seqs, chunk_rows, read_from,
                            temperature=data.draw(st.sampled_from([1.0, 0.7])),
                            bias=data.draw(st.booleans()))


@pytest.mark.parametrize("seqs,read_from", [(GRPO, [3] * 4), (UNSHARED, [1, 0, 1]),
                                            (SEQS, [2, 3, 0, 1, 1])])
@pytest.mark.parametrize("chunk_rows", [1, 2, 4, 64])
def test_grpo_tree_and_unshared_batches(seqs, read_from, chunk_rows):
    check_against_reference(seqs, chunk_rows, read_from, temperature=0.7, pad=4)


def test_gradients_pass_gradcheck():
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX, pad_to_multiple_of=4)
    assert torch.autograd.gradcheck(
        lambda h, w, b: tuple(hidden_token_stats(h, w, plan, bias=b, temperature=0.7,
                                                 read_from=[2, 3, 0, 1, 1], chunk_rows=3)),
        tuple(head(plan)))
    assert torch.autograd.gradcheck(
        lambda h, w: hidden_token_stats(h, w, plan, with_entropy=False, chunk_rows=2)[0],
        tuple(head(plan, bias=False)[:2]))


def test_tied_embeddings_get_one_gradient_from_both_uses():
    """The head's weight is the embedding matrix: its gradient sums the head's and the
    embedding's, as with the model's own tied head."""
    plan = build_plan(GRPO, SHARE_EVERY_PREFIX)
    embedding = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, requires_grad=True)
    hidden = F.embedding(plan.input_ids, embedding).tanh()
    got = torch.autograd.grad(loss(*hidden_token_stats(hidden, embedding, plan, chunk_rows=3)),
                              embedding, retain_graph=True)[0]
    want = torch.autograd.grad(loss(*reference(hidden, embedding, None, plan, 1.0, None)),
                               embedding)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


class _Produced(TorchDispatchMode):
    """Every tensor an op produces (forward and backward): its shape, and how many hidden
    rows went through the head's matmul (``linear``/``mm`` outputs with ``VOCAB`` columns)."""

    def __init__(self):
        super().__init__()
        self.shapes, self.head_rows = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
                if func.__name__.split(".")[0] in ("addmm", "mm") and t.shape[-1] == VOCAB:
                    self.head_rows += t.shape[0]
        return out


def largest_with_a_vocabulary_dimension(shapes) -> int:
    return max(torch.Size(s).numel() for s in shapes if VOCAB in s)


def test_no_tensor_with_a_vocabulary_dimension_is_larger_than_one_chunk():
    """Checked on every op output of the forward and the backward: nothing beyond a
    ``(chunk_rows, vocab)`` chunk or the weight's own ``(vocab, hidden)`` gradient. The
    control (the plain head over the same rows) builds the ``(rows, vocab)`` logits."""
    base = [i % VOCAB for i in range(1, 40)]
    plan = build_plan([base + [1, 2], base + [3], base + [4, 5, 6]], SHARE_EVERY_PREFIX)
    hidden, weight, bias = head(plan, dtype=torch.float32)
    with _Produced() as seen:
        stats = hidden_token_stats(hidden, weight, plan, bias=bias, chunk_rows=4)
        loss(*stats).backward()
    bound = max(4 * VOCAB, VOCAB * HIDDEN)
    assert largest_with_a_vocabulary_dimension(seen.shapes) <= bound
    with _Produced() as control:
        loss(*reference(hidden, weight, bias, plan, 1.0, None)).backward()
    assert largest_with_a_vocabulary_dimension(control.shapes) >= plan.num_tokens_flat * VOCAB
    assert plan.num_tokens_flat * VOCAB > 4 * bound


def test_each_distinct_read_row_goes_through_the_head_once_per_pass():
    """GRPO read from the prompt's last position on: the four responses' first tokens are all
    predicted by one shared row; the prompt rows before it are never multiplied."""
    plan = build_plan(GRPO, SHARE_EVERY_PREFIX)
    hidden, weight, bias = head(plan)
    read_from = [3] * 4
    rows = plan.kv_index[read_positions(plan, read_from)].unique().numel()
    assert rows == 1 + sum(len(s) - 4 for s in GRPO)  # the shared row + each response's own
    with _Produced() as forward:
        stats = hidden_token_stats(hidden, weight, plan, bias=bias, read_from=read_from,
                                   chunk_rows=3)
    with _Produced() as backward:
        loss(*stats).backward()
    assert forward.head_rows == rows  # forward: one product per row
    assert backward.head_rows == rows  # backward: the recomputed logits, once per row


def test_without_entropy_the_log_probs_and_their_gradients_are_unchanged():
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX)
    hidden, weight, bias = head(plan)
    alone = hidden_token_stats(hidden, weight, plan, bias=bias, with_entropy=False, chunk_rows=2)
    both = hidden_token_stats(hidden, weight, plan, bias=bias, chunk_rows=2)
    assert alone.entropy is None
    assert torch.equal(alone.log_probs, both.log_probs)
    for a, b in zip(torch.autograd.grad(alone.log_probs.sum(), [hidden, weight, bias]),
                    torch.autograd.grad(both.log_probs.sum(), [hidden, weight, bias])):
        assert torch.equal(a, b)


def test_autocast_runs_the_head_in_its_dtype_forward_and_backward():
    """Under CPU autocast (bf16) the chunked head equals the plain bf16 head's logits taken to
    fp32, to bf16 rounding; outputs stay fp32 and the gradients reach the fp32 leaves."""
    plan = build_plan(GRPO, SHARE_EVERY_PREFIX)
    hidden, weight, bias = head(plan, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hidden_token_stats(hidden, weight, plan, bias=bias, chunk_rows=3)
        logits = F.linear(hidden, weight, bias)
    assert logits.dtype == torch.bfloat16 and got.log_probs.dtype == torch.float32
    want = plain_token_log_probs(plan.restore(logits).float(), plan.split(plan.token_ids))
    torch.testing.assert_close(got.log_probs, want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, want[1], rtol=0, atol=1e-5)
    grads = torch.autograd.grad(loss(*got), [hidden, weight, bias])
    assert all(g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("bounds", [[(0, 6), (6, 11)], [(0, 3), (3, 4), (4, 11)]])
def test_a_split_vocabulary_gives_the_whole_vocabulary_results(bounds):
    """Each vocabulary slice of the head in its own thread, as a tensor-parallel rank: the
    same outputs on every shard, the weight's gradient slice by slice, and the hidden states'
    gradient as the sum of the shards' shares (the caller's all-reduce)."""
    plan = build_plan(SEQS, SHARE_EVERY_PREFIX)
    hidden, weight, bias = head(plan)
    kwargs = dict(temperature=0.7, read_from=[2, 3, 0, 1, 1], chunk_rows=3)
    def rank_main(shard, start, stop):
        local = [t.detach().clone().requires_grad_() for t in
                 (hidden, weight[start:stop], bias[start:stop])]
        stats = hidden_token_stats(local[0], local[1], plan, bias=local[2], vocab_shard=shard,
                                   **kwargs)
        return stats, torch.autograd.grad(loss(*stats), local)

    results = run_shards(bounds, rank_main)
    whole = hidden_token_stats(hidden, weight, plan, bias=bias, **kwargs)
    want = torch.autograd.grad(loss(*whole), [hidden, weight, bias])
    for stats, _ in results:
        torch.testing.assert_close(stats.log_probs, whole.log_probs, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(stats.entropy, whole.entropy, rtol=1e-10, atol=1e-10)
    grads = [g for _, g in results]
    torch.testing.assert_close(sum(g[0] for g in grads), want[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([g[1] for g in grads]), want[1], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(torch.cat([g[2] for g in grads]), want[2], rtol=1e-9, atol=1e-10)


def test_refuses_inputs_of_another_layout():
    plan = build_plan([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"flat_hidden must be \(T_flat=3, hidden_size\)"):
        hidden_token_stats(torch.zeros(4, HIDDEN), torch.zeros(VOCAB, HIDDEN), plan)
    with pytest.raises(ValueError, match="reading cannot start at 3"):
        hidden_token_stats(torch.zeros(3, HIDDEN), torch.zeros(VOCAB, HIDDEN), plan,
                           read_from=[3])
    with pytest.raises(ValueError, match="temperature must be positive; got 0"):
        linear_log_probs(torch.zeros(3, HIDDEN), torch.zeros(VOCAB, HIDDEN),
                         torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                         temperature=0)
