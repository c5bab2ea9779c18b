"""prefix_attention: a plan's flat layout attends exactly like each whole sequence would."""

import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention import prefix_attention
from prefix_sharing.testing.tiny_decoder import causal_attend
from tests.strategies import forests

HEADS, KV_HEADS, DIM, VOCAB, MAX_POS = 4, 2, 8, 6, 64


def projections(seed=0):
    """q/k/v of a token depend on its id and position only, like a first attention layer's."""
    g = torch.Generator().manual_seed(seed)
    token = torch.randn(VOCAB, 16, generator=g, dtype=torch.float64, requires_grad=True)
    position = torch.randn(MAX_POS, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, (HEADS + 2 * KV_HEADS) * DIM, generator=g, dtype=torch.float64)
    return token, position, w


def qkv(token_table, position_table, w, ids, positions):
    x = (token_table[ids] + position_table[positions]) @ w
    q, k, v = x.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    return q.view(-1, HEADS, DIM), k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM)


@pytest.mark.parametrize("execution", ["auto", "gather"])  # auto: over sources in place
@settings(max_examples=60)
@given(forests())
def test_outputs_and_gradients_equal_per_sequence_attention(execution, seqs):
    token, position, w = projections()
    plain = []
    for s in seqs:
        ids = torch.tensor(s)
        plain.append(causal_attend(*qkv(token, position, w, ids, torch.arange(len(s)))))
    plain = torch.cat(plain)

    plan = build_plan(seqs, PrefixSharingConfig(min_prefix_len=1), pad_to_multiple_of=4)
    shared = plan.restore(prefix_attention(*qkv(token, position, w, plan.input_ids, plan.position_ids), plan,
                                             execution=execution))
    torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)

    grad = torch.randn_like(plain)
    for a, b in zip(torch.autograd.grad(shared, (token, position), grad),
                    torch.autograd.grad(plain, (token, position), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_refuses_tensors_from_another_layout():
    plan = build_plan([[1, 2, 3], [1, 2, 4]], PrefixSharingConfig(min_prefix_len=1))
    q = torch.zeros(6, HEADS, DIM)
    with pytest.raises(ValueError, match="q has 6 tokens but the plan lays out 4"):
        prefix_attention(q, q, q, plan)


class _CountKeyGathers(TorchDispatchMode):
    """Counts index_select calls on K/V-shaped tensors (KV_HEADS heads; q has HEADS)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.index_select.default and (
            args[0].dim() == 3 and args[0].size(1) == KV_HEADS)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("seqs, execution, gathers", [
    ([[1, 2, 3, 4], [1, 2, 5]], "auto", 0),  # a reuser's tail reads a's prefix in place
    ([[1, 2, 3, 4], [1, 2, 5]], "gather", 2),  # the same, forced to copy K and V
    ([[1, 2, 3, 4, 5], [1, 2, 3], [1, 2]], "auto", 0),  # a chain of strict prefixes
])
def test_gathers_k_and_v_only_when_the_gather_is_chosen(seqs, execution, gathers):
    token, position, w = projections()
    plan = build_plan(seqs, PrefixSharingConfig(min_prefix_len=1))
    q, k, v = qkv(token, position, w, plan.input_ids, plan.position_ids)
    with _CountKeyGathers() as counter:
        out = prefix_attention(q, k, v, plan, execution=execution)
    assert counter.calls == gathers
    plain = torch.cat([causal_attend(*qkv(token, position, w, torch.tensor(s),
                                          torch.arange(len(s)))) for s in seqs])
    torch.testing.assert_close(plan.restore(out), plain, rtol=1e-10, atol=1e-10)
