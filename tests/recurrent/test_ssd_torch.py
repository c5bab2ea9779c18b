"""The torch Mamba-2 (SSD) kernels: the chunked scan equals the token-by-token recurrence in
float64, and transformers' own Nemotron-H torch scan (an independent implementation)."""

import inspect

import pytest
import torch

from prefix_sharing.recurrent.ssd_torch import chunk_ssd_torch, discretize_dt, ssd_recurrent

HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5


def inputs(total=29, num_states=1, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x = dict(x=randn(total, HEADS, HEAD_DIM), dt=torch.rand(total, HEADS, generator=gen,
                                                            dtype=dtype),
             A=-torch.rand(HEADS, generator=gen, dtype=dtype) * 2,
             B=randn(total, GROUPS, STATE), C=randn(total, GROUPS, STATE), D=randn(HEADS))
    return x, randn(num_states, HEADS, HEAD_DIM, STATE)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("cu", [(0, 29), (0, 1, 9, 9 + 13, 29)])
def test_chunked_scan_equals_the_token_by_token_recurrence(chunk_size, cu):
    x, h0 = inputs(num_states=len(cu) - 1)
    ref, ref_final = ssd_recurrent(**x, initial_state=h0, cu_seqlens_host=cu)
    out, final = chunk_ssd_torch(**x, initial_state=h0, cu_seqlens_host=cu,
                                 output_final_state=True, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-12, atol=1e-12)


def test_the_recurrence_is_the_state_space_model():
    """One head, one token at a time, written out: ``S = e^(dt A) S + dt x B^T; y = S C + D x``."""
    x, h0 = inputs(total=3)
    out, final = ssd_recurrent(**x, initial_state=h0)
    state = h0[0, 1]
    for t in range(3):
        dt = x["dt"][t, 1]
        state = (dt * x["A"][1]).exp() * state + dt * torch.outer(x["x"][t, 1], x["B"][t, 0])
        y = state @ x["C"][t, 0] + x["D"][1] * x["x"][t, 1]
        torch.testing.assert_close(out[t, 1], y, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(final[0, 1], state, rtol=1e-13, atol=1e-13)


def test_the_initial_state_matters_and_zero_is_the_default():
    x, h0 = inputs()
    with_state, _ = chunk_ssd_torch(**x, initial_state=h0)
    default, none = chunk_ssd_torch(**x)
    zero, _ = chunk_ssd_torch(**x, initial_state=torch.zeros_like(h0))
    assert none is None
    torch.testing.assert_close(default, zero, rtol=0, atol=0)
    assert (with_state - zero).abs().max() > 1e-3


def test_matches_transformers_nemotron_h_torch_scan():
    """transformers' ``mamba2_chunk_scan`` (batch-major, float32, its torch code under the
    kernel-hub decorator) with a raw dt, bias, softplus and the time-step floor."""
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, h0 = inputs(dtype=torch.float32)
    raw, bias = torch.randn(29, HEADS), torch.randn(HEADS)
    limit = (0.001, float("inf"))
    theirs, their_final = inspect.unwrap(nemotron_h.mamba2_chunk_scan)(
        x["x"][None], raw[None], x["A"], x["B"][None], x["C"][None], chunk_size=8, D=x["D"],
        dt_bias=bias, dt_softplus=True, dt_limit=limit, initial_states=h0,
        return_final_states=True)
    ours, final = chunk_ssd_torch(**dict(x, dt=discretize_dt(raw, bias, limit)),
                                  initial_state=h0, output_final_state=True)
    torch.testing.assert_close(ours, theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, their_final, rtol=1e-5, atol=1e-5)
