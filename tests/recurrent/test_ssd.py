"""The Mamba-2 (SSD) scan over a plan's schedule equals each sequence run plainly from a zero
state (outputs and every input gradient), a finite-difference gradcheck of the state passing,
and the mamba_ssm backend's argument construction against the kernel's documented semantics
(a CPU stand-in for mamba_ssm's Triton kernel)."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.errors import InputError, MissingPackageError
from prefix_sharing.recurrent import (
    chunk_ssd,
    recurrence_schedule,
    resolve_ssd_backend,
    ssd_over_schedule,
)
from prefix_sharing.recurrent.ssd_torch import ssd_recurrent
from prefix_sharing.workloads import WORKLOADS, make_workload

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
HEADS, HEAD_DIM, GROUPS, STATE = 4, 3, 2, 5


def flat_inputs(rows, dtype=torch.float64, seed=0, heads=HEADS, head_dim=HEAD_DIM,
                groups=GROUPS, state=STATE):
    gen = torch.Generator().manual_seed(seed)
    x = dict(x=torch.randn(rows, heads, head_dim, generator=gen, dtype=dtype),
             dt=F.softplus(torch.randn(rows, heads, generator=gen, dtype=dtype)),
             B=torch.randn(rows, groups, state, generator=gen, dtype=dtype),
             C=torch.randn(rows, groups, state, generator=gen, dtype=dtype))
    params = dict(A=-torch.rand(heads, generator=gen, dtype=dtype) - 0.1,
                  D=torch.randn(heads, generator=gen, dtype=dtype))
    return ({n: t.requires_grad_() for n, t in x.items()},
            {n: t.requires_grad_() for n, t in params.items()})


def plain_recurrence(x, params, plan):
    """Each sequence from its own first token, token by token: no schedule, no state passing."""
    per_token = {n: t.index_select(0, plan.kv_index) for n, t in x.items()}
    out, _ = ssd_recurrent(**per_token, **params, cu_seqlens_host=plan.cu_seqlens.tolist())
    return out


@pytest.mark.parametrize("workload", WORKLOADS)
def test_scan_over_the_schedule_equals_every_sequence_run_plainly(workload):
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX, pad_to_multiple_of=4)
    x, params = flat_inputs(plan.num_tokens_flat)
    shared = plan.restore(ssd_over_schedule(**x, **params, schedule=recurrence_schedule(plan),
                                            backend="torch"))
    plain = plain_recurrence(x, params, plan)
    torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)
    weights = torch.rand(plain.shape, generator=torch.Generator().manual_seed(3),
                         dtype=plain.dtype)
    inputs = [*x.values(), *params.values()]
    shared_grads = torch.autograd.grad((shared * weights).sum(), inputs, retain_graph=True)
    plain_grads = torch.autograd.grad((plain * weights).sum(), inputs)
    for a, b in zip(shared_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_state_passing_passes_a_finite_difference_gradcheck():
    """Three pieces over two buckets (b continues a's state after row 2): the gradient reaching
    the provider's rows (and A, D) through the initial state is the numerical one."""
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9]], EVERY_PREFIX)
    schedule = recurrence_schedule(plan)
    assert len(schedule.buckets) == 2
    x, params = flat_inputs(plan.num_tokens_flat, heads=2, head_dim=2, groups=1, state=2)

    def run(x_, dt, B, C, A, D):
        return ssd_over_schedule(x_, dt, A, B, C, schedule, D=D, backend="torch")

    tensors = (x["x"], x["dt"], x["B"], x["C"], params["A"], params["D"])
    assert torch.autograd.gradcheck(run, tensors, eps=1e-6, atol=1e-7)


def test_one_call_without_boundaries_is_one_sequence():
    x, params = flat_inputs(7)
    out, final = chunk_ssd(**x, **params, output_final_state=True, backend="torch")
    ref, ref_final = ssd_recurrent(**x, **params)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(final, ref_final)


def test_backend_resolution():
    assert resolve_ssd_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(InputError, match="unknown SSD-kernel backend 'cuda'"):
        resolve_ssd_backend("cuda", torch.device("cpu"))


def test_mamba_backend_without_mamba_ssm_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(MissingPackageError, match="pip install mamba-ssm"):
        resolve_ssd_backend("mamba_ssm", torch.device("cpu"))


# ------------------------------------------------------- mamba_ssm argument construction
def fake_mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                   initial_states=None, seq_idx=None, cu_seqlens=None,
                                   dt_softplus=False, dt_limit=(0.0, float("inf")),
                                   return_final_states=False, return_varlen_states=False):
    """mamba_ssm's documented contract (``ssd_combined.py``), checked, then computed token by
    token: batch rows independent, each from its own initial state; ``seq_idx`` would zero the
    state at every sequence boundary and varlen states have no backward, so the stand-in refuses
    both (the wrapper must not rely on them)."""
    batch, seqlen, heads, head_dim = x.shape
    assert dt.shape == (batch, seqlen, heads) and A.shape == (heads,)
    assert B.shape == C.shape and B.shape[:2] == (batch, seqlen) and heads % B.size(2) == 0
    assert D is None or D.shape == (heads,)
    assert initial_states is None or (
        initial_states.shape == (batch, heads, head_dim, B.size(3))
        and initial_states.dtype == torch.float32)
    assert seq_idx is None and not return_varlen_states and z is None
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    cu = range(0, batch * seqlen + 1, seqlen)
    out, final = ssd_recurrent(x.flatten(0, 1), dt.flatten(0, 1), A, B.flatten(0, 1),
                               C.flatten(0, 1), D=D, initial_state=initial_states,
                               cu_seqlens_host=cu)
    out = out.view(batch, seqlen, heads, head_dim)
    return (out, final.float()) if return_final_states else out


@pytest.fixture
def fake_mamba(monkeypatch):
    """``mamba_ssm`` importable on CPU, its scan replaced by the stand-in above."""
    modules = {}
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton",
                 "mamba_ssm.ops.triton.ssd_combined"):
        modules[name] = types.ModuleType(name)
        modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["mamba_ssm.ops.triton.ssd_combined"].mamba_chunk_scan_combined = (
        fake_mamba_chunk_scan_combined)


@pytest.mark.parametrize("workload", ["tree", "agent"])
def test_mamba_backend_arguments_give_the_torch_results(fake_mamba, workload):
    """Pieces of unequal length in one bucket: the right padding (dt = 0) must leave every
    final state, and so every child piece, as the torch backend computes it."""
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX)
    schedule = recurrence_schedule(plan)
    assert len(schedule.buckets) > 1
    x, params = flat_inputs(plan.num_tokens_flat, dtype=torch.float32)
    outs = [ssd_over_schedule(**x, **params, schedule=schedule, backend=b)
            for b in ("mamba_ssm", "torch")]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    grads = [torch.autograd.grad(o.square().sum(), [*x.values(), *params.values()])
             for o in outs]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
