"""token_log_probs: the plain per-sequence log-probs and entropy, read from flat logits."""

import pytest
import torch
from hypothesis import given
from torch.utils._python_dispatch import TorchDispatchMode

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.logprobs import token_log_probs
from prefix_sharing.equivalence import plain_token_log_probs
from tests.strategies import forests

VOCAB = 11


def flat_logits(plan, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(plan.num_tokens_flat, VOCAB, generator=g, dtype=torch.float64) * 3


@given(forests())
def test_equal_to_plain_log_probs_of_the_restored_logits(seqs):
    plan = build_plan(seqs, PrefixSharingConfig(min_prefix_len=1), pad_to_multiple_of=3)
    flat = flat_logits(plan).requires_grad_()
    stats = token_log_probs(flat, plan)
    ref_lp, ref_ent = plain_token_log_probs(plan.restore(flat), [torch.tensor(s) for s in seqs])
    torch.testing.assert_close(stats.log_probs, ref_lp.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.entropy, ref_ent.float(), rtol=1e-6, atol=1e-6)
    assert stats.log_probs[plan.is_last_token].eq(0).all()

    weights = torch.randn(plan.num_tokens_total, dtype=torch.float32)
    got = torch.autograd.grad((weights * stats.log_probs).sum() + stats.entropy.sum(), flat)[0]
    want = torch.autograd.grad((weights * ref_lp).sum() + ref_ent.sum(), flat)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_temperature_divides_the_logits():
    plan = build_plan([[1, 2, 3, 4], [1, 2, 3, 5]], PrefixSharingConfig(min_prefix_len=1))
    flat = flat_logits(plan)
    hot = token_log_probs(flat, plan, temperature=2.0)
    ref = token_log_probs(flat / 2.0, plan)
    torch.testing.assert_close(hot.log_probs, ref.log_probs)
    torch.testing.assert_close(hot.entropy, ref.entropy)
    assert token_log_probs(flat, plan, with_entropy=False).entropy is None


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
