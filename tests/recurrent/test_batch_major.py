"""The batch-major stand-ins for fla's calls compute, per sequence, what the kernels compute on
that sequence alone: each row of a batch, or each segment of a packed row, from its own state."""

import pytest
import torch
import torch.nn.functional as F

from prefix_sharing.errors import InputError
from prefix_sharing.recurrent.batch_major import (
    causal_conv1d_batch_major,
    gated_delta_rule_batch_major,
)
from prefix_sharing.recurrent.torch_kernels import gated_delta_rule_recurrent

from .test_torch_kernels import inputs

CU = (0, 1, 9, 22, 29)  # a 1-token sequence, odd lengths


def _per_sequence_recurrence(x, h0, cu, **kwargs):
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        out, final = gated_delta_rule_recurrent(**{k: t[a:b] for k, t in x.items()},
                                                initial_state=h0[n:n + 1], **kwargs)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs), torch.cat(finals)


@pytest.mark.parametrize("token_by_token", [False, True])
@pytest.mark.parametrize("cu_as_tensor", [False, True])
def test_a_packed_row_runs_each_segment_from_its_own_state(token_by_token, cu_as_tensor):
    x, h0 = inputs(num_states=len(CU) - 1)
    ref, ref_final = _per_sequence_recurrence(x, h0, CU, use_qk_l2norm_in_kernel=True)
    cu = torch.tensor(CU, dtype=torch.int32) if cu_as_tensor else CU
    out, final = gated_delta_rule_batch_major(
        *(x[n][None] for n in ("q", "k", "v", "g", "beta")), initial_state=h0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        token_by_token=token_by_token, chunk_size=64)  # a caller's keyword, ignored
    assert out.shape == (1, 29, 4, 5)
    torch.testing.assert_close(out[0], ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-12, atol=1e-12)


def test_each_row_of_a_batch_is_a_sequence():
    x, h0 = inputs(total=3 * 7, num_states=3)
    ref, _ = _per_sequence_recurrence(x, h0, (0, 7, 14, 21))
    out, final = gated_delta_rule_batch_major(
        *(x[n].view(3, 7, *x[n].shape[1:]) for n in ("q", "k", "v", "g", "beta")),
        initial_state=h0)
    assert final is None
    torch.testing.assert_close(out.flatten(0, 1), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_the_convolution_restarts_at_every_segment(activation):
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = (torch.randn(1, 29, 6, generator=gen, dtype=torch.float64),
                       torch.randn(6, 4, generator=gen, dtype=torch.float64),
                       torch.randn(6, generator=gen, dtype=torch.float64))
    out, state = causal_conv1d_batch_major(x, weight, bias, activation=activation,
                                           cu_seqlens=torch.tensor(CU))
    refs = []
    for a, b in zip(CU[:-1], CU[1:]):
        ref = F.conv1d(x[0, a:b].T[None], weight[:, None], bias, padding=3, groups=6)[0, :, :b - a]
        refs.append(ref.T if activation is None else F.silu(ref.T))
    assert state is None
    torch.testing.assert_close(out[0], torch.cat(refs), rtol=1e-12, atol=1e-12)


def test_the_convolution_refuses_states():
    x, weight = torch.randn(1, 5, 2), torch.randn(2, 4)
    with pytest.raises(InputError, match="starts every sequence from zeros"):
        causal_conv1d_batch_major(x, weight, initial_state=torch.zeros(1, 2, 4))
    with pytest.raises(InputError, match="one row; got a batch of 2"):
        causal_conv1d_batch_major(torch.randn(2, 5, 2), weight, cu_seqlens=(0, 5))
