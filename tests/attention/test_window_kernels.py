"""Sliding windows and sinks on every kernel: the accelerator backends' window arguments,
checked on CPU against the fakes written from each kernel's documentation, equal the torch
backend's band; the kernels without a sink term refuse sinks before running."""

import pytest
import torch

from prefix_sharing.attention import varlen_attention, varlen_attention_torch
from prefix_sharing.errors import UnsupportedSetup
from tests.attention.test_kernel_backends import (  # noqa: F401  (fixtures)
    K_LENS, Q_LENS, cu, flash, inputs, npu, te,
)

# shorter than every tail, inside the longest prefix, one key, longer than every segment
WINDOWS = [1, 3, 8, 40]
KERNEL_DTYPE = {"flash_attn": torch.float16, "te": torch.bfloat16, "npu": torch.float32}
TOLERANCE = {"flash_attn": 2e-3, "te": 1e-2, "npu": 1e-5}


def windowed(backend, q, k, v, window, **kw):
    return varlen_attention(q, k, v, cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS), 0.4,
                            window=window, backend=backend, **kw)


def check_window(backend, window):
    q, k, v = inputs(4, 2, KERNEL_DTYPE[backend])
    out = windowed(backend, q, k, v, window)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = varlen_attention_torch(q64, k64, v64, cu(Q_LENS), cu(K_LENS), max(Q_LENS),
                                 max(K_LENS), 0.4, window=window)
    tol = TOLERANCE[backend]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", WINDOWS)
def test_flash_attn_window_is_a_left_band(flash, window):
    check_window("flash_attn", window)
    assert flash.calls[0]["window_size"] == (window - 1, 0)


@pytest.mark.parametrize("window", WINDOWS)
def test_te_window_is_a_left_band(te, window):
    check_window("te", window)


@pytest.mark.parametrize("window", WINDOWS)
def test_npu_window_is_band_mode(npu, window):
    check_window("npu", window)
    (call,) = npu.calls
    assert (call["sparse_mode"], call["pre_tockens"], call["next_tockens"]) == (4, window - 1, 0)


def test_npu_without_window_stays_right_down_causal(npu):
    q, k, v = inputs(4, 2, torch.float32)
    windowed("npu", q, k, v, None)
    assert npu.calls[0]["sparse_mode"] == 3


@pytest.mark.parametrize("backend", ["flash_attn", "te", "npu"])
def test_kernels_without_a_sink_term_refuse_sinks(backend, flash, te, npu):
    q, k, v = inputs(4, 2, KERNEL_DTYPE[backend])
    with pytest.raises(UnsupportedSetup, match=r"sinks.*backend='torch'"):
        windowed(backend, q, k, v, None, sinks=torch.zeros(4))
    assert flash.calls == [] and te.instances == [] and npu.calls == []
