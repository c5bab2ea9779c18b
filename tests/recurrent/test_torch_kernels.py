"""The torch Gated DeltaNet kernels: the chunked rule equals the token-by-token recurrence (and
transformers' own torch implementation); the gather convolution equals ``F.conv1d``."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from prefix_sharing.recurrent.torch_kernels import (
    causal_conv1d_torch,
    chunk_gated_delta_rule_torch,
    gated_delta_rule_recurrent,
)


def inputs(total=29, heads=2, value_heads=4, key_dim=6, value_dim=5, num_states=1,
           dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return dict(q=randn(total, heads, key_dim), k=randn(total, heads, key_dim),
                v=randn(total, value_heads, value_dim),
                g=-torch.rand(total, value_heads, generator=gen, dtype=dtype) * 2,
                beta=torch.rand(total, value_heads, generator=gen, dtype=dtype)), \
        randn(num_states, value_heads, key_dim, value_dim)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
@pytest.mark.parametrize("cu", [(0, 29), (0, 1, 9, 9 + 13, 29)])
@pytest.mark.parametrize("l2norm", [False, True])
def test_chunked_rule_equals_the_token_by_token_recurrence(chunk_size, cu, l2norm):
    x, h0 = inputs(num_states=len(cu) - 1)
    ref, ref_final = gated_delta_rule_recurrent(**x, initial_state=h0, cu_seqlens_host=cu,
                                                use_qk_l2norm_in_kernel=l2norm, scale=0.3)
    out, final = chunk_gated_delta_rule_torch(**x, initial_state=h0, cu_seqlens_host=cu,
                                              output_final_state=True, chunk_size=chunk_size,
                                              use_qk_l2norm_in_kernel=l2norm, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-12, atol=1e-12)


def test_the_initial_state_matters_and_zero_is_the_default():
    x, h0 = inputs()
    with_state, _ = chunk_gated_delta_rule_torch(**x, initial_state=h0)
    zero, _ = chunk_gated_delta_rule_torch(**x, initial_state=torch.zeros_like(h0))
    default, none = chunk_gated_delta_rule_torch(**x)
    assert none is None
    torch.testing.assert_close(default, zero, rtol=0, atol=0)
    assert (with_state - zero).abs().max() > 1e-3


def test_matches_transformers_torch_chunk_gated_delta_rule():
    """transformers' Qwen3-Next implementation (batch-major, one sequence per row) as an
    independent reference for scale, the q/k L2 norm and grouped value heads (its torch code:
    with fla installed transformers binds the name to fla's Triton kernel)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, h0 = inputs(dtype=torch.float32)
    ref, ref_final = inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule)(
        *(x[n][None] for n in ("q", "k", "v", "g", "beta")), chunk_size=8,
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = chunk_gated_delta_rule_torch(**x, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_gather_convolution_equals_conv1d_on_one_sequence(activation):
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = (torch.randn(11, 6, generator=gen), torch.randn(6, 4, generator=gen),
                       torch.randn(6, generator=gen))
    back = torch.arange(11)[:, None] - torch.arange(3, 0, -1)[None, :]
    out = causal_conv1d_torch(x, weight, bias, back.clamp(min=-1), activation)
    ref = F.conv1d(x.T[None], weight[:, None], bias, padding=3, groups=6)[0, :, :11].T
    ref = ref if activation is None else F.silu(ref)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_gather_convolution_in_bfloat16_rounds_once_as_conv1d():
    """bf16: accumulated in float32 and rounded once to bf16 before the activation, as
    ``F.conv1d`` in bf16 does (rounding after every tap is several bf16 steps off)."""
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = (torch.randn(40, 64, generator=gen).bfloat16(),
                       torch.randn(64, 4, generator=gen).bfloat16(),
                       torch.randn(64, generator=gen).bfloat16())
    back = torch.arange(40)[:, None] - torch.arange(3, 0, -1)[None, :]
    out = causal_conv1d_torch(x, weight, bias, back.clamp(min=-1), "silu")
    ref = F.silu(F.conv1d(x.T[None], weight[:, None], bias, padding=3, groups=64)[0, :, :40].T)
    exact = F.silu(F.conv1d(x.double().T[None], weight.double()[:, None], bias.double(),
                            padding=3, groups=64)[0, :, :40].T)
    assert out.dtype == torch.bfloat16
    assert (out.double() - exact).abs().max() <= (ref.double() - exact).abs().max()


def test_convolution_refuses_unknown_activation_and_bad_predecessors():
    x, weight = torch.zeros(3, 2), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        causal_conv1d_torch(x, weight, None, torch.zeros(3, 3, dtype=torch.long), "gelu")
    with pytest.raises(ValueError, match=r"predecessors must be \(3, 3\)"):
        causal_conv1d_torch(x, weight, None, torch.zeros(3, 2, dtype=torch.long))
