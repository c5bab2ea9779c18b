"""The kernels' documented limits (prefix_sharing/attention/kernel_limits.py) hold in the
backend functions: refused before the call with the number, or - the NPU segment count - met
by calling the kernel several times. Checked against the fakes, which enforce the same limits
as the kernels document them (tests/attention/fake_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.attention import npu_backend, te_backend, varlen_attention_torch
from prefix_sharing.attention.flash_attn_backend import varlen_attention_flash
from prefix_sharing.attention.kernel_limits import (
    FLASH_ATTN_MAX_HEAD_DIM,
    NPU_MAX_HEAD_DIM,
    NPU_MAX_HEADS,
    NPU_MAX_SEGMENTS,
    TE_MAX_HEAD_DIM,
    segment_chunks,
)
from prefix_sharing.attention.npu_backend import varlen_attention_npu
from prefix_sharing.attention.te_backend import varlen_attention_te
from prefix_sharing.attention.torch_backend import (
    attention_lse_backward_torch,
    attention_lse_torch,
)
from prefix_sharing.errors import UnsupportedSetup
from tests.attention import fake_kernels


def _segments(q_lens, k_lens, heads=2, kv_heads=1, head_dim=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), kv_heads, head_dim, generator=g).to(dtype)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k, max(q_lens), max(k_lens)


def test_segment_chunks_cover_every_segment_in_order():
    assert segment_chunks(5, limit=2) == [(0, 2), (2, 4), (4, 5)]
    assert segment_chunks(NPU_MAX_SEGMENTS) == [(0, NPU_MAX_SEGMENTS)]


# ----------------------------------------------------------------- flash-attn
def test_flash_attn_refuses_head_dims_beyond_256_before_the_kernel(monkeypatch):
    kernel = fake_kernels.install_flash_attn(monkeypatch)
    too_wide = _segments([3], [5], head_dim=FLASH_ATTN_MAX_HEAD_DIM + 8)
    with pytest.raises(UnsupportedSetup, match="head dims up to 256; this model's is 264"):
        varlen_attention_flash(*too_wide)
    assert kernel.calls == []
    with pytest.raises(AssertionError, match="at most 256"):  # as the kernel would
        kernel.flash_attn_varlen_func(*too_wide, causal=True)
    out = varlen_attention_flash(*_segments([3], [5], head_dim=FLASH_ATTN_MAX_HEAD_DIM))
    assert out.shape == (3, 2, FLASH_ATTN_MAX_HEAD_DIM)


def test_flash_attn_refuses_float32_when_called_directly(monkeypatch):
    fake_kernels.install_flash_attn(monkeypatch)
    with pytest.raises(UnsupportedSetup,
                       match=r"\(flash-attn with q in torch\.float32\): .*float16 and "
                             "bfloat16 only"):
        varlen_attention_flash(*_segments([3], [5], dtype=torch.float32))


# ----------------------------------------------------------------- Transformer Engine
def test_te_before_2_2_is_refused_naming_the_floor(monkeypatch):
    monkeypatch.setattr(te_backend, "_MODULES", {})
    fake_kernels.install_transformer_engine(monkeypatch, version="2.1.0")
    with pytest.raises(UnsupportedSetup, match=r"transformer-engine 2\.1\.0\): .* >= 2\.2"):

        varlen_attention_te(*_segments([3, 2], [5, 2]))


def test_te_before_2_2_has_no_kernel_for_these_segment_lengths(monkeypatch):
    """Why the floor: the fake, like TE's FusedAttention before 2.2, needs multiples of 64."""
    cls = fake_kernels.install_transformer_engine(monkeypatch, version="2.1.0")
    attention = cls(2, 8, num_gqa_groups=1, qkv_format="thd",
                    attn_mask_type="padding_causal_bottom_right")
    q, k, v, cu_q, cu_k, max_q, max_k = _segments([3, 2], [5, 2])
    with pytest.raises(AssertionError, match="No dot product attention backend"):
        attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max_q,
                  max_seqlen_kv=max_k)


@pytest.mark.parametrize("version", ["2.2.0", "2.10.0+cu12"])
def test_te_from_2_2_runs_any_segment_lengths(monkeypatch, version):
    monkeypatch.setattr(te_backend, "_MODULES", {})
    fake_kernels.install_transformer_engine(monkeypatch, version=version)
    q, k, v, *bounds = _segments([3, 2], [5, 2])
    ref = varlen_attention_torch(q.double(), k.double(), v.double(), *bounds)
    torch.testing.assert_close(varlen_attention_te(q, k, v, *bounds).double(), ref,
                               rtol=2e-2, atol=2e-2)  # bf16 output


def test_te_refuses_head_dims_beyond_256(monkeypatch):
    monkeypatch.setattr(te_backend, "_MODULES", {})
    cls = fake_kernels.install_transformer_engine(monkeypatch)
    with pytest.raises(UnsupportedSetup, match="head dims up to 256; this model's is 264"):
        varlen_attention_te(*_segments([3], [5], head_dim=TE_MAX_HEAD_DIM + 8))
    assert cls.instances == []


# ----------------------------------------------------------------- torch_npu
def test_npu_runs_more_segments_than_one_call_takes_in_several_calls(monkeypatch):
    monkeypatch.setattr(npu_backend, "_COMPRESSED_MASKS", {})
    kernel = fake_kernels.install_torch_npu(monkeypatch)
    count = NPU_MAX_SEGMENTS + 6
    q_lens = [1 + i % 3 for i in range(count)]
    k_lens = [n + i % 2 for i, n in enumerate(q_lens)]
    q, k, v, cu_q, cu_k, max_q, max_k = _segments(q_lens, k_lens, dtype=torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = varlen_attention_npu(q, k, v, cu_q, cu_k, max_q, max_k,
                               cu_seqlens_q_host=cu_q.tolist(), cu_seqlens_k_host=cu_k.tolist())
    assert [c["segments"] for c in kernel.calls] == [NPU_MAX_SEGMENTS, 6]
    ref = varlen_attention_torch(q.double(), k.double(), v.double(), cu_q, cu_k, max_q, max_k)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_npus_with_lse_pair_runs_more_segments_than_one_call_takes_in_several_calls(
        monkeypatch):
    """The dense rectangles of shared nodes (no mask) over more segments than one call takes,
    some without queries - the second call's last ones - forward and backward, against the
    torch pair in float64: the softmax statistics are read back call by call."""
    monkeypatch.setattr(npu_backend, "_COMPRESSED_MASKS", {})
    kernel = fake_kernels.install_torch_npu(monkeypatch)
    count = NPU_MAX_SEGMENTS + 6
    q_lens = [(1 + i % 3) * (i % 5 != 1) * (i < count - 2) for i in range(count)]
    k_lens = [1 + i % 4 for i in range(count)]
    q, k, v, cu_q, cu_k, max_q, max_k = _segments(q_lens, k_lens, dtype=torch.float32)
    args = (cu_q, cu_k, max_q, max_k, None)
    hosts = dict(causal=False, cu_seqlens_q_host=cu_q.tolist(), cu_seqlens_k_host=cu_k.tolist())
    out, lse = npu_backend.attention_lse_npu(q, k, v, *args, **hosts)
    want_out, want_lse = attention_lse_torch(q.double(), k.double(), v.double(), *args, **hosts)
    assert [c["segments"] for c in kernel.calls] == [NPU_MAX_SEGMENTS, 6]
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = npu_backend.attention_lse_backward_npu(dout, q, k, v, out, lse, *args, **hosts)
    want = attention_lse_backward_torch(dout.double(), q.double(), k.double(), v.double(),
                                        want_out, want_lse, *args, **hosts)
    assert [c["segments"] for c in kernel.backward_calls] == [NPU_MAX_SEGMENTS, 6]
    assert float(grads[1][cu_k[-3]:].abs().max()) == float(grads[2][cu_k[-3]:].abs().max()) == 0
    for g, r in zip(grads, want, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, message", [
    (dict(head_dim=NPU_MAX_HEAD_DIM + 8), "head dim 776 \\(1 to 768\\)"),
    (dict(heads=NPU_MAX_HEADS + 8, kv_heads=8), "264 query heads \\(1 to 256\\)"),
])
def test_npu_refuses_shapes_beyond_its_documented_range(monkeypatch, shape, message):
    kernel = fake_kernels.install_torch_npu(monkeypatch)
    with pytest.raises(UnsupportedSetup, match=message):
        varlen_attention_npu(*_segments([3], [5], **shape))
    assert kernel.calls == []
