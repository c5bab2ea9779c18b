"""varlen_attention_torch against a padded, einsum-written reference."""

import pytest
import torch

from prefix_sharing.attention import varlen_attention_torch
from tests.attention.host_reads import count_host_reads


def padded_reference(q, k, v, q_lens, k_lens, scale):
    """One segment at a time, scores written out, bottom-right causal mask, GQA by repeat."""
    out, qs, ks = [], 0, 0
    group = q.size(1) // k.size(1)
    for s, L in zip(q_lens, k_lens):
        qi = q[qs : qs + s].double()
        ki = k[ks : ks + L].double().repeat_interleave(group, dim=1)
        vi = v[ks : ks + L].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        allowed = torch.arange(L)[None, :] <= torch.arange(s)[:, None] + (L - s)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi))
        qs, ks = qs + s, ks + L
    return torch.cat(out)


def cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_reference_on_odd_segments(heads, kv_heads, scale):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    # tails of every kind: whole sequence, one token, one token over one key, odd pairs
    q_lens, k_lens = [7, 1, 1, 13, 5, 20], [7, 9, 1, 31, 5, 21]
    d = 8
    q = torch.randn(sum(q_lens), heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(k_lens), kv_heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(k_lens), kv_heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    out = varlen_attention_torch(q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), scale)
    ref = padded_reference(q, k, v, q_lens, k_lens, scale or d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_single_segment_returns_a_contiguous_tensor():
    q = torch.randn(5, 2, 4)
    out = varlen_attention_torch(q, q, q, cu([5]), cu([5]), 5, 5)
    assert out.shape == (5, 2, 4) and out.is_contiguous()


def test_host_boundaries_spare_the_device_reads():
    q_lens, k_lens = [3, 1, 4], [3, 5, 4]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), 2, 4, generator=g)
    k, v = torch.randn(2, sum(k_lens), 2, 4, generator=g)
    args = (q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens))
    host = dict(cu_seqlens_q_host=tuple(cu(q_lens).tolist()),
                cu_seqlens_k_host=tuple(cu(k_lens).tolist()))
    reads, out = {}, {}
    for name, kwargs in (("device", {}), ("host", host)):
        def step(name=name, kwargs=kwargs):
            out[name] = varlen_attention_torch(*args, **kwargs)

        reads[name] = count_host_reads(step)
    assert reads == {"device": {"value_reads": 2, "syncing_ops": 0},
                     "host": {"value_reads": 0, "syncing_ops": 0}}
    torch.testing.assert_close(out["host"], out["device"], rtol=0, atol=0)
