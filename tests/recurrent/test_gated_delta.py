"""The Gated DeltaNet recurrence and convolution over a plan's schedule equal each sequence run
plainly from a zero state (outputs and every input gradient), a finite-difference gradcheck of
the state passing, and the fla backend's argument construction against the kernels' documented
semantics (CPU stand-ins for fla's Triton kernels)."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.errors import InputError, MissingPackageError
from prefix_sharing.recurrent import (
    causal_conv1d_over_schedule,
    chunk_gated_delta_rule,
    gated_delta_rule_over_schedule,
    recurrence_schedule,
    resolve_recurrent_backend,
)
from prefix_sharing.recurrent import fla_kernels
from prefix_sharing.recurrent.torch_kernels import gated_delta_rule_recurrent
from prefix_sharing.workloads import WORKLOADS, make_workload

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, WIDTH = 2, 4, 8, 6, 4


def flat_inputs(rows, dtype=torch.float64, seed=0, heads=HEADS, value_heads=VALUE_HEADS,
                key_dim=KEY_DIM, value_dim=VALUE_DIM):
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(q=(heads, key_dim), k=(heads, key_dim), v=(value_heads, value_dim),
                  g=(value_heads,), beta=(value_heads,))
    x = {n: torch.randn(rows, *s, generator=gen, dtype=dtype) for n, s in shapes.items()}
    x["g"] = -F.softplus(x["g"])
    x["beta"] = x["beta"].sigmoid()
    return {n: t.requires_grad_() for n, t in x.items()}


def plain_recurrence(x, plan):
    """Each sequence from its own first token, token by token: no schedule, no state passing."""
    per_token = {n: t.index_select(0, plan.kv_index) for n, t in x.items()}
    out, _ = gated_delta_rule_recurrent(**per_token, cu_seqlens_host=plan.cu_seqlens.tolist(),
                                        use_qk_l2norm_in_kernel=True)
    return out


def check_same_values_and_grads(shared, plain, inputs):
    weights = torch.rand(plain.shape, generator=torch.Generator().manual_seed(3),
                         dtype=plain.dtype)
    torch.testing.assert_close(shared, plain, rtol=1e-10, atol=1e-10)
    shared_grads = torch.autograd.grad((shared * weights).sum(), inputs, retain_graph=True)
    plain_grads = torch.autograd.grad((plain * weights).sum(), inputs)
    for a, b in zip(shared_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_recurrence_over_the_schedule_equals_every_sequence_run_plainly(workload):
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX, pad_to_multiple_of=4)
    x = flat_inputs(plan.num_tokens_flat)
    out = gated_delta_rule_over_schedule(**x, schedule=recurrence_schedule(plan),
                                         use_qk_l2norm_in_kernel=True, backend="torch")
    check_same_values_and_grads(plan.restore(out), plain_recurrence(x, plan), list(x.values()))


@pytest.mark.parametrize("workload", WORKLOADS)
def test_convolution_over_the_schedule_equals_conv1d_per_sequence(workload):
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(plan.num_tokens_flat, 5, generator=gen, dtype=torch.float64,
                    requires_grad=True)
    weight = torch.randn(5, WIDTH, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    out = causal_conv1d_over_schedule(x, weight, bias, recurrence_schedule(plan),
                                      activation="silu", backend="torch")
    plain = torch.cat([F.silu(F.conv1d(s.T[None], weight[:, None], bias, padding=WIDTH - 1,
                                       groups=5)[0, :, : len(s)].T)
                       for s in plan.split(x.index_select(0, plan.kv_index))])
    check_same_values_and_grads(plan.restore(out), plain, [x, weight, bias])


def test_state_passing_passes_a_finite_difference_gradcheck():
    """Three pieces over two buckets (b continues a's state after row 2): the gradient reaching
    the provider's rows through the initial state is the numerical one."""
    plan = build_plan([[5, 6, 7, 8], [5, 6, 7, 9, 9]], EVERY_PREFIX)
    schedule = recurrence_schedule(plan)
    assert len(schedule.buckets) == 2
    names = ("q", "k", "v", "g", "beta")
    x = flat_inputs(plan.num_tokens_flat, heads=1, value_heads=2, key_dim=3, value_dim=2)

    def run(*tensors):
        return gated_delta_rule_over_schedule(*tensors, schedule=schedule,
                                              use_qk_l2norm_in_kernel=True, backend="torch")

    assert torch.autograd.gradcheck(run, tuple(x[n] for n in names), eps=1e-6, atol=1e-7)


def test_one_call_without_boundaries_is_one_sequence():
    x = flat_inputs(7)
    out, final = chunk_gated_delta_rule(**x, output_final_state=True, backend="torch")
    ref, ref_final = gated_delta_rule_recurrent(**x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(final, ref_final)


def test_backend_resolution():
    assert resolve_recurrent_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(InputError, match="unknown recurrent-kernel backend 'cuda'"):
        resolve_recurrent_backend("cuda", torch.device("cpu"))


# ---------------------------------------------------------------- fla argument construction
def fake_fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                    output_final_state=False, use_qk_l2norm_in_kernel=False,
                                    cu_seqlens=None, cu_seqlens_cpu=None):
    """fla's documented contract, checked, then computed token by token."""
    assert q.dim() == 4 and q.size(0) == 1, "varlen inputs are one batch row"
    assert cu_seqlens.dtype == torch.long and cu_seqlens.device == q.device
    assert cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
    assert initial_state is None or (initial_state.dtype == torch.float32
                                     and initial_state.size(0) == cu_seqlens.numel() - 1)
    out, final = gated_delta_rule_recurrent(
        q[0], k[0], v[0], g[0], beta[0], scale=scale, initial_state=initial_state,
        cu_seqlens_host=cu_seqlens_cpu.tolist(), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out[None], final.float() if output_final_state else None


def fake_fla_causal_conv1d(x, weight, bias=None, initial_state=None, output_final_state=False,
                           activation=None, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla's documented contract: per sequence, column ``W + i`` of its ``(D, W)`` initial
    state is the input ``i`` steps before it (``i = -1 .. -(W-1)``)."""
    assert x.size(0) == 1 and cu_seqlens.dtype == torch.long and not output_final_state
    width = weight.size(1)
    assert initial_state.shape == (cu_seqlens.numel() - 1, x.size(2), width)
    outs = []
    for n, (a, b) in enumerate(zip(cu_seqlens_cpu[:-1].tolist(), cu_seqlens_cpu[1:].tolist())):
        seq = torch.cat([initial_state[n, :, 1:], x[0, a:b].T], 1)  # [D, W-1+len]
        out = F.conv1d(seq[None], weight[:, None], bias, groups=x.size(2))[0].T
        outs.append(out if activation is None else F.silu(out))
    return torch.cat(outs)[None], None


@pytest.fixture
def fake_fla(monkeypatch):
    """``fla`` importable on CPU, its two kernels replaced by the stand-ins above."""
    modules = {}
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules",
                 "fla.modules.causal_conv1d"):
        modules[name] = types.ModuleType(name)
        modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fake_fla_chunk_gated_delta_rule
    modules["fla.modules.causal_conv1d"].causal_conv1d = fake_fla_causal_conv1d


@pytest.mark.parametrize("workload", ["tree", "agent"])
def test_fla_backend_arguments_give_the_torch_results(fake_fla, workload):
    plan = build_plan(make_workload(workload).sequences, EVERY_PREFIX)
    schedule = recurrence_schedule(plan)
    x = flat_inputs(plan.num_tokens_flat, dtype=torch.float32)
    outs = [gated_delta_rule_over_schedule(**x, schedule=schedule, use_qk_l2norm_in_kernel=True,
                                           backend=b) for b in ("fla", "torch")]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    conv_in, weight = x["v"].flatten(1), torch.randn(VALUE_HEADS * VALUE_DIM, WIDTH)
    convs = [causal_conv1d_over_schedule(conv_in, weight, None, schedule, activation="silu",
                                         backend=b) for b in ("fla", "torch")]
    torch.testing.assert_close(convs[0], convs[1], rtol=1e-5, atol=1e-5)


def test_fla_initial_conv_state_layout():
    args = fla_kernels.conv_arguments(
        torch.zeros(5, 2), torch.zeros(2, 3), None,
        torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]), activation="silu",
        cu_seqlens=torch.tensor([0, 5], dtype=torch.int32), cu_seqlens_host=(0, 5))
    # [M=1, D=2, W=3]: column 0 unused, then the two earlier inputs, oldest first
    assert args["initial_state"].tolist() == [[[0.0, 1.0, 3.0], [0.0, 2.0, 4.0]]]
    assert args["x"].shape == (1, 5, 2) and args["cu_seqlens"].dtype == torch.long


def test_fla_backend_without_fla_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(MissingPackageError, match="pip install fla-core"):
        resolve_recurrent_backend("fla", torch.device("cpu"))
