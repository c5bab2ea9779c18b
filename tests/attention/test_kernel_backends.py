"""The accelerator backends build their kernel's arguments right: checked on CPU against fakes
written from each kernel's documentation (tests/attention/fake_kernels.py), and compared with
varlen_attention_torch. Also: which backend "auto" picks, and the errors for missing packages."""

import importlib.util
import sys
import types

import pytest
import torch

from prefix_sharing.attention import varlen_attention, varlen_attention_torch
from prefix_sharing.attention import npu_backend, te_backend
from prefix_sharing.attention.backends import get_backend, resolve_backend
from prefix_sharing.errors import InputError, MissingPackageError, UnsupportedSetup
from tests.attention import fake_kernels

# tails of every kind: whole sequence, one token over many keys, one token over one key, odd pairs
Q_LENS, K_LENS = [7, 1, 1, 13, 5, 20], [7, 9, 1, 31, 5, 21]
HEAD_DIM = 8
KERNEL_PACKAGES = ("flash_attn", "transformer_engine", "torch_npu")


def cu(lens, dtype=torch.int32):
    return torch.tensor([0, *lens]).cumsum(0).to(dtype)


def inputs(heads, kv_heads, dtype, seed=0, v_head_dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)

    def tensor(tokens, h, d=HEAD_DIM):
        return torch.randn(tokens, h, d, generator=g, dtype=torch.float64).to(dtype)

    q = tensor(sum(Q_LENS), heads).requires_grad_()
    k = tensor(sum(K_LENS), kv_heads).requires_grad_()
    v = tensor(sum(K_LENS), kv_heads, v_head_dim).requires_grad_()
    return q, k, v


# multi-latent attention's shape in small: q/k head dim 8, v head dim 5 (DeepSeek-V3: 192 / 128)
MLA_V_HEAD_DIM = 5


def reference(q, k, v, scale):
    """varlen_attention_torch in float64 on the same values, and its input gradients."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = varlen_attention_torch(
        q64, k64, v64, cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS), scale
    )
    return out, (q64, k64, v64)


@pytest.fixture
def flash(monkeypatch):
    return fake_kernels.install_flash_attn(monkeypatch)


@pytest.fixture
def te(monkeypatch):
    monkeypatch.setattr(te_backend, "_MODULES", {})  # no module built by another test's fake
    return fake_kernels.install_transformer_engine(monkeypatch)


@pytest.fixture
def npu(monkeypatch):
    monkeypatch.setattr(npu_backend, "_COMPRESSED_MASKS", {})
    return fake_kernels.install_torch_npu(monkeypatch)


GQA_AND_SCALE = pytest.mark.parametrize(
    "heads, kv_heads, scale", [(4, 4, None), (4, 2, 0.3), (6, 1, None), (6, 3, 1.7)]
)


def check_against_reference(backend, q, k, v, scale, tol, cu_dtype=torch.int32):
    out = varlen_attention(
        q, k, v, cu(Q_LENS, cu_dtype), cu(K_LENS, cu_dtype), max(Q_LENS), max(K_LENS), scale,
        backend=backend,
    )
    ref, ref_inputs = reference(q, k, v, scale)
    assert out.shape == (*q.shape[:-1], v.size(-1)) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)

    g = torch.Generator().manual_seed(1)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, ref_inputs, grad.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


# ---------------------------------------------------------------- flash-attn


@GQA_AND_SCALE
def test_flash_attn_matches_reference(flash, heads, kv_heads, scale):
    q, k, v = inputs(heads, kv_heads, torch.float16)
    check_against_reference("flash_attn", q, k, v, scale, tol=2e-3)
    assert flash.calls[0] == dict(causal=True, dropout_p=0.0, softmax_scale=scale,
                                  window_size=(-1, -1), return_attn_probs=False)


def test_flash_attn_takes_int64_cu_seqlens(flash):
    q, k, v = inputs(4, 2, torch.bfloat16)
    check_against_reference("flash_attn", q, k, v, None, tol=1e-2, cu_dtype=torch.int64)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_flash_attn_pads_a_smaller_value_head_dim_and_trims_the_output(flash, heads, kv_heads):
    """flash-attn 2 takes one head dim (its fake asserts k.shape == v.shape): V goes in
    zero-padded to q's, the output and V's gradient come back at V's own width."""
    q, k, v = inputs(heads, kv_heads, torch.float16, v_head_dim=MLA_V_HEAD_DIM)
    check_against_reference("flash_attn", q, k, v, 0.3, tol=2e-3)
    assert len(flash.calls) == 1


def test_flash_attn_refuses_a_larger_value_head_dim(flash):
    q, k, v = inputs(4, 2, torch.float16, v_head_dim=HEAD_DIM + 1)
    with pytest.raises(UnsupportedSetup, match="value head dim 9 is larger"):
        varlen_attention(q, k, v, cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS),
                         backend="flash_attn")
    assert flash.calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flash_attn_refuses_full_precision_before_the_kernel(flash, dtype):
    q, k, v = inputs(4, 2, dtype)
    with pytest.raises(ValueError, match=rf"{dtype}.*backend='torch'"):
        varlen_attention(q, k, v, cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS),
                         backend="flash_attn")
    assert flash.calls == []


# ---------------------------------------------------------------- Transformer Engine


@GQA_AND_SCALE
def test_te_matches_reference(te, heads, kv_heads, scale):
    q, k, v = inputs(heads, kv_heads, torch.float16)
    check_against_reference("te", q, k, v, scale, tol=2e-3)
    (module,) = te.instances
    assert (module.num_attention_heads, module.num_gqa_groups, module.kv_channels) == (
        heads, kv_heads, HEAD_DIM)
    assert module.softmax_scale == (HEAD_DIM**-0.5 if scale is None else scale)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_te_takes_different_key_and_value_head_dims(te, heads, kv_heads):
    q, k, v = inputs(heads, kv_heads, torch.bfloat16, v_head_dim=MLA_V_HEAD_DIM)
    check_against_reference("te", q, k, v, None, tol=1e-2)
    (module,) = te.instances
    assert module.kv_channels == (HEAD_DIM, MLA_V_HEAD_DIM)
    assert module.softmax_scale == HEAD_DIM**-0.5  # the key's head dim, as TE defaults it


def test_torch_takes_different_key_and_value_head_dims():
    q, k, v = inputs(4, 2, torch.float32, v_head_dim=MLA_V_HEAD_DIM)
    check_against_reference("torch", q, k, v, 0.3, tol=1e-5)


def test_te_builds_one_module_per_configuration(te):
    q, k, v = inputs(4, 2, torch.bfloat16)
    args = (cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS))
    for scale in (None, None, 0.3, HEAD_DIM**-0.5):  # None and headdim**-0.5 are the same scale
        varlen_attention(q, k, v, *args, scale, backend="te")
    q_mha, k_mha, v_mha = inputs(4, 4, torch.bfloat16)
    varlen_attention(q_mha, k_mha, v_mha, *args, backend="te")
    assert len(te.instances) == 3


def test_te_keeps_one_module_per_layer_cache(te):
    """Each layer passes its own kernel_cache: TE's kernel choice and FP8 state stay per layer."""
    q, k, v = inputs(4, 2, torch.bfloat16)
    args = (cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS))
    layers = [{}, {}]
    for _ in range(2):  # two steps
        for cache in layers:
            varlen_attention(q, k, v, *args, backend="te", kernel_cache=cache)
    assert len(te.instances) == 2
    (first,), (second,) = (cache.values() for cache in layers)
    assert first is not second and te_backend._MODULES == {}


# ---------------------------------------------------------------- torch_npu


@GQA_AND_SCALE
def test_npu_matches_reference(npu, heads, kv_heads, scale):
    q, k, v = inputs(heads, kv_heads, torch.float32)
    check_against_reference("npu", q, k, v, scale, tol=1e-5)
    (call,) = npu.calls
    assert call["actual_seq_qlen"] == cu(Q_LENS)[1:].tolist()
    assert call["actual_seq_kvlen"] == cu(K_LENS)[1:].tolist()
    assert call["scale"] == (HEAD_DIM**-0.5 if scale is None else scale)


def test_npu_takes_host_boundaries_without_reading_the_device(npu):
    q, k, v = inputs(4, 2, torch.float32)
    host = dict(cu_seqlens_q_host=tuple(cu(Q_LENS).tolist()),
                cu_seqlens_k_host=tuple(cu(K_LENS).tolist()))
    # boundary tensors that would be wrong if read: the kernel must take the host lists
    zeros = torch.zeros(len(Q_LENS) + 1, dtype=torch.int32)
    varlen_attention(q, k, v, zeros, zeros, max(Q_LENS), max(K_LENS), backend="npu", **host)
    (call,) = npu.calls
    assert call["actual_seq_qlen"] == list(host["cu_seqlens_q_host"][1:])
    assert call["actual_seq_kvlen"] == list(host["cu_seqlens_k_host"][1:])


def test_npu_builds_the_compressed_mask_once_per_device(npu):
    q, k, v = inputs(4, 2, torch.float32)
    for _ in range(2):
        varlen_attention(q, k, v, cu(Q_LENS), cu(K_LENS), max(Q_LENS), max(K_LENS), backend="npu")
    first, second = npu.calls
    assert first["atten_mask"] is second["atten_mask"]


# ---------------------------------------------------------------- choosing a backend

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


def install_kernels(monkeypatch, installed):
    """Fake flash-attn / Transformer Engine as installed or absent."""
    for package, install in (("flash_attn", fake_kernels.install_flash_attn),
                             ("transformer_engine", fake_kernels.install_transformer_engine)):
        if package in installed:
            install(monkeypatch)
        else:
            fake_kernels.hide(monkeypatch, package)


HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "installed, expected",
    [
        (("flash_attn", "transformer_engine"), "flash_attn"),
        (("flash_attn",), "flash_attn"),
        (("transformer_engine",), "te"),
        ((), "torch"),
    ],
)
def test_auto_on_cuda_picks_the_fastest_installed_for_half_precision(
    monkeypatch, installed, expected, dtype
):
    install_kernels(monkeypatch, installed)
    assert resolve_backend("auto", CUDA, dtype) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_on_cuda_picks_torch_for_full_precision(monkeypatch, dtype):
    # flash-attn has no float32 kernel, TE (2.9, 2.10) no float32 THD kernel
    install_kernels(monkeypatch, ("flash_attn", "transformer_engine"))
    assert resolve_backend("auto", CUDA, dtype) == "torch"


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_auto_on_npu_picks_npu(dtype):
    # torch.device("npu") exists only once torch_npu is imported; resolve_backend reads .type
    assert resolve_backend("auto", types.SimpleNamespace(type="npu"), dtype) == "npu"


@pytest.mark.parametrize("dtype", [*HALF, torch.float32])
def test_auto_on_cpu_picks_torch(monkeypatch, dtype):
    install_kernels(monkeypatch, ("flash_attn", "transformer_engine"))
    assert resolve_backend("auto", torch.device("cpu"), dtype) == "torch"


def test_a_named_backend_is_kept_for_a_dtype_it_computes_in():
    for name in ("torch", "flash_attn", "te", "npu", "flex"):
        assert resolve_backend(name, torch.device("cpu"), torch.bfloat16) == name
    assert resolve_backend("npu", torch.device("cpu"), torch.float32) == "npu"
    assert resolve_backend("torch", torch.device("cpu"), torch.float64) == "torch"


@pytest.mark.parametrize("name, dtype", [("flash_attn", torch.float32), ("te", torch.float32),
                                         ("npu", torch.float64)])
def test_a_named_backend_refuses_a_dtype_it_cannot_compute_in(name, dtype):
    """Bad input, printed by the command as one line (an InputError is a ValueError)."""
    with pytest.raises(InputError, match=rf"'{name}' computes in .* but q is {dtype}.*'torch'"):
        resolve_backend(name, CUDA, dtype)


def test_unknown_backend_names_the_choices():
    with pytest.raises(InputError, match="'flash'.*auto, torch, flash_attn, te, npu"):
        resolve_backend("flash", CUDA, torch.bfloat16)


@pytest.mark.parametrize(
    "name, package, extra",
    [("flash_attn", "flash_attn", "cuda"), ("te", "transformer_engine", "cuda"),
     ("npu", "torch_npu", "npu")],
)
def test_missing_kernel_package_says_which_extra_to_install(monkeypatch, name, package, extra):
    fake_kernels.hide(monkeypatch, package)
    with pytest.raises(MissingPackageError, match=rf"{package}.*pip install 'prefix-sharing\[{extra}\]'"):
        get_backend(name)


def test_backend_modules_import_without_their_packages(monkeypatch):
    fake_kernels.hide(monkeypatch, *KERNEL_PACKAGES)
    for name in ("flash_attn_backend", "te_backend", "npu_backend"):
        # a fresh copy of the module, executed while the packages are absent
        spec = importlib.util.find_spec(f"prefix_sharing.attention.{name}")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for package in KERNEL_PACKAGES:  # they stayed absent while the copies ran
        assert importlib.util.find_spec(package) is None, package
        with pytest.raises(ImportError):
            importlib.import_module(package)


def test_no_fake_outlives_its_test():
    for name in (*KERNEL_PACKAGES, "transformer_engine.pytorch"):
        module = sys.modules.get(name)
        assert module is None or getattr(module, "__file__", None) is not None, name
