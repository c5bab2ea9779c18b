"""Pure-torch stand-ins for the accelerator kernels, written from their documentation.

Each fake checks the arguments the way its documentation states them, then computes the
documented attention in float64, one segment at a time with einsum. They are independent of
``varlen_attention_torch``, which the tests compare them against.

Sources:
- flash-attn: ``flash_attn_varlen_func`` docstring, Dao-AILab/flash-attention
  ``flash_attn/flash_attn_interface.py`` (causal=True aligned bottom-right since 2.1; GQA).
- Transformer Engine: ``DotProductAttention`` docstrings, NVIDIA/TransformerEngine
  ``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``
  (thd format, int32 cu_seqlens of equal shape, ``padding_causal_bottom_right``, output
  ``[t, h*dv]``; ``kv_channels`` an int or a ``(k_channels, v_channels)`` tuple).
- torch_npu: Ascend/op-plugin ``docs/context/torch_npu-npu_fusion_attention.md`` (TND layout,
  cumulative ``actual_seq_qlen``/``actual_seq_kvlen`` without a leading 0, sparse_mode 3 =
  rightDownCausal with the compressed 2048x2048 mask, sparse_mode 4 = band of pre_tockens /
  next_tockens around the same diagonal, sparse_mode 0 without a mask = every key, a query
  length of 0 allowed, Nq a multiple of Nkv; at most 1K segments per varlen call, head dim
  1~768, Nq 1~256); its softmax_max / softmax_sum outputs as op-plugin's
  FlashAttentionKernelNpuOpApi.cpp allocates them in TND (``[T, N, 8]`` float32) in the row
  layout MindSpeed's TND ring attention reads (``flatten_softmax`` in
  ``mindspeed/core/context_parallel/utils.py``: segment by segment, ``[N, s_b, 8]``), and
  ``npu_fusion_attention_grad``'s keywords as op-plugin declares them (``softmax_max``,
  ``softmax_sum``, ``attention_in``, ``scale_value``). Windows: flash-attn ``window_size=(left, right)`` and TE's
  forward ``window_size`` bound the keys to ``[i + L - s - left, i + L - s + right]``
  (bottom-right, as their causal masks).
- FlexAttention: ``torch.nn.attention.flex_attention.flex_attention`` docstring (torch 2.13:
  q ``(B, Hq, L, E)``, k ``(B, Hkv, S, E)``, v ``(B, Hkv, S, Ev)``, ``enable_gqa`` broadcasting
  key head ``h // (Hq // Hkv)``, ``scale`` defaulting to ``E ** -0.5``, the ``block_mask``'s
  ``mask_mod`` deciding which (query, key) pairs are scored, ``return_aux=AuxRequest(lse=True)``
  the natural-log logsumexp ``(B, Hq, L)``); differentiable, which the CPU op is not.

Limits (see ``prefix_sharing/attention/kernel_limits.py`` for the sources): flash-attn 2 head
dims up to 256; TE's THD kernels head dims up to 256 and, before TE 2.2, bottom-right segments
only when the longest are multiples of 64.

``install_*`` put a fake into ``sys.modules`` through pytest's ``monkeypatch`` (so it is removed
when the test ends) with a ``__spec__``, so ``importlib.util.find_spec`` reports it installed;
``hide`` makes a package look absent even where it is installed.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch

__all__ = ["hide", "install_flash_attn", "install_torch_npu", "install_transformer_engine"]


def hide(monkeypatch: pytest.MonkeyPatch, *packages: str) -> None:
    """Make ``packages`` unimportable (``find_spec`` returns None) for the current test."""
    for name in packages:
        monkeypatch.setitem(sys.modules, name, None)


def _module(name: str, *, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    return module


def _segment_attention(q, k, v, bounds_q, bounds_k, scale, left=None, causal=True,
                       with_lse=False):
    """Bottom-right causal attention per segment in float64: the documented semantics of all
    three kernels. q [Tq, h, d], k/v [Tk, hk, d]; query head j reads key head j // (h // hk).
    ``left``: a sliding window's keys before the diagonal (query i of s over L keys reads keys
    ``L - s + i - left .. L - s + i``: flash-attn's ``window_size[0]``, TE's too, torch_npu's
    ``pre_tockens`` in band mode); None for none. ``causal=False``: every key (a segment may
    then hold no query). ``with_lse``: also the log-sum-exp ``[h, Tq]`` float32."""
    out, lses = [], []
    for qs, qe, ks, ke, allowed in _segment_masks(bounds_q, bounds_k, left, causal):
        qi, ki, vi = _segment_tensors(q, k, v, qs, qe, ks, ke)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        lses.append(scores.logsumexp(-1))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi))
    out = torch.cat(out).to(q.dtype) if out else q.new_zeros(0, q.size(1), v.size(-1))
    if not with_lse:
        return out
    return out, (torch.cat(lses, 1) if lses else q.new_zeros(q.size(1), 0)).float()


def _segment_masks(bounds_q, bounds_k, left, causal):
    """``(qs, qe, ks, ke, allowed [s, L])`` per segment with queries."""
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        s, L = qe - qs, ke - ks
        if not causal:
            assert left is None, "this fake models windows with causal masks only"
            if s:
                yield qs, qe, ks, ke, torch.ones(s, L, dtype=torch.bool)
            continue
        assert 0 < s <= L, f"segment with {s} queries over {L} keys: outside what this fake models"
        diagonal = torch.arange(s)[:, None] + (L - s)
        allowed = torch.arange(L)[None, :] <= diagonal
        if left is not None:
            allowed &= torch.arange(L)[None, :] >= diagonal - left
        yield qs, qe, ks, ke, allowed


def _segment_tensors(q, k, v, qs, qe, ks, ke):
    group = q.size(1) // k.size(1)
    return (q[qs:qe].double(), k[ks:ke].double().repeat_interleave(group, dim=1),
            v[ks:ke].double().repeat_interleave(group, dim=1))


def _segment_attention_backward(dout, q, k, v, out, lse, bounds_q, bounds_k, scale, left,
                                causal):
    """``(dq, dk, dv)`` at the given ``out`` and ``lse`` ``[h, Tq]``, written out (float64):
    ``P = exp(scale q.k - lse)``, ``dv = P^T dout``, ``dS = P (dout v^T - rowsum(dout out))``,
    ``dq = scale dS k``, ``dk = scale dS^T q``; GQA summed over a key head's query heads."""
    group = q.size(1) // k.size(1)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    for qs, qe, ks, ke, allowed in _segment_masks(bounds_q, bounds_k, left, causal):
        qi, ki, vi = _segment_tensors(q, k, v, qs, qe, ks, ke)
        do, oi = dout[qs:qe].double(), out[qs:qe].double()
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        probs = (scores - lse[:, qs:qe, None].double()).exp().masked_fill(~allowed, 0.0)
        d_probs = torch.einsum("qhd,khd->hqk", do, vi)
        rowsum = (do * oi).sum(-1).t()[..., None]  # [h, s, 1]
        d_scores = probs * (d_probs - rowsum)
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", d_scores, ki) * scale
        for name, grad in (("k", torch.einsum("hqk,qhd->khd", d_scores, qi) * scale),
                           ("v", torch.einsum("hqk,qhd->khd", probs, do))):
            summed = grad.view(grad.size(0), -1, group, grad.size(-1)).sum(2)
            (dk if name == "k" else dv)[ks:ke] = summed
    return dq, dk, dv


def _check_qkv(q, k, v, v_head_dim=None):
    """``v_head_dim``: the value head dim a kernel was told (TE's ``kv_channels=(dk, dv)``);
    None: one head dim for q, k and v (flash-attn 2)."""
    assert q.dim() == k.dim() == v.dim() == 3, "q, k, v must be (tokens, heads, headdim)"
    assert q.dtype == k.dtype == v.dtype, "q, k, v must share a dtype"
    if v_head_dim is None:
        assert k.shape == v.shape, "k and v must have the same shape"
    else:
        assert k.shape[:-1] == v.shape[:-1], "k and v must have the same tokens and heads"
        assert v.size(-1) == v_head_dim, "v's head dim must equal kv_channels[1]"
    assert q.size(-1) == k.size(-1), "q and k must have the same head dim"
    assert q.size(1) % k.size(1) == 0, "query heads must be a multiple of key/value heads"


def _check_cu_seqlens(cu_q, cu_k, q, k):
    for name, cu, x in (("cu_seqlens_q", cu_q, q), ("cu_seqlens_k", cu_k, k)):
        assert isinstance(cu, torch.Tensor) and cu.dim() == 1, f"{name} must be a 1-D tensor"
        assert cu.dtype == torch.int32, f"{name} must be int32, got {cu.dtype}"
        assert cu.device == q.device, f"{name} must be on q's device"
        assert cu[0] == 0 and cu[-1] == x.size(0), f"{name} must run from 0 to the token count"
        assert bool((cu[1:] >= cu[:-1]).all()), f"{name} must be non-decreasing"
    assert cu_q.shape == cu_k.shape, "cu_seqlens_q and cu_seqlens_k must have the same shape"


# ---------------------------------------------------------------- flash-attn


class _FlashAttn:
    def __init__(self):
        self.calls: list[dict] = []
        self.backward_calls: list[dict] = []

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    ):
        self.calls.append(dict(causal=causal, dropout_p=dropout_p, softmax_scale=softmax_scale,
                               window_size=window_size, return_attn_probs=return_attn_probs))
        _check_qkv(q, k, v)
        assert q.dtype in (torch.float16, torch.bfloat16), f"flash-attn has no {q.dtype} kernel"
        assert q.size(-1) <= 256, "FlashAttention forward only supports head dimension at most 256"
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k)
        for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q),
                                ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
            assert isinstance(bound, int), f"{name} must be a Python int"
            assert bound >= int((cu[1:] - cu[:-1]).max()), f"{name} is below the longest segment"
        left, right = window_size
        assert causal is True or (left, right) == (-1, -1), (
            "causal=True (bottom-right since flash-attn 2.1), or causal=False without a window")
        assert dropout_p == 0.0, "expected dropout_p=0.0"
        assert (left, right) == (-1, -1) or (left >= 0 and right == 0), (
            f"window_size={window_size}: a causal band is (left >= 0, 0), no window (-1, -1)"
        )
        assert softcap == 0.0 and alibi_slopes is None
        assert block_table is None
        scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
        result = _segment_attention(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), scale,
                                    None if left < 0 else left, causal, return_attn_probs)
        if not return_attn_probs:
            return result
        # documented: out, softmax_lse (nheads, total_q) float32, S_dmask (dropout only)
        return result[0], result[1], None

    def _flash_attn_varlen_backward(
        self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
        zero_tensors=False,
    ):
        """flash_attn_interface._flash_attn_varlen_backward (flash-attn >= 2.6): writes dq,
        dk, dv in place, returns them and softmax_d."""
        self.backward_calls.append(dict(causal=causal, deterministic=deterministic,
                                        window=(window_size_left, window_size_right)))
        _check_qkv(q, k, v)
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k)
        for x, like in ((dout, q), (out, q), (dq, q), (dk, k), (dv, v)):
            assert x.shape == like.shape and x.dtype == like.dtype, "dout/out/dq/dk/dv shapes"
        assert softmax_lse.shape == (q.size(1), q.size(0)) and softmax_lse.dtype == torch.float32
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
        assert isinstance(softmax_scale, float), "softmax_scale must be given as a float"
        left = None if window_size_left < 0 else window_size_left
        grads = _segment_attention_backward(
            dout, q, k, v, out, softmax_lse, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(),
            softmax_scale, left, causal)
        for target, grad in zip((dq, dk, dv), grads):
            target.copy_(grad)
        return dq, dk, dv, None


def install_flash_attn(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A fake ``flash_attn`` package; its ``calls`` list records each call's keyword arguments."""
    kernel = _FlashAttn()
    module = _module("flash_attn", package=True)
    module.flash_attn_varlen_func = kernel.flash_attn_varlen_func
    module.calls, module.backward_calls = kernel.calls, kernel.backward_calls
    module.flash_attn_interface = _module("flash_attn.flash_attn_interface")
    module.flash_attn_interface._flash_attn_varlen_backward = kernel._flash_attn_varlen_backward
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface",
                        module.flash_attn_interface)
    return module


# ---------------------------------------------------------------- Transformer Engine

_TE_MASK_TYPES = {
    "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
    "padding_causal_bottom_right", "arbitrary",
}


class _DotProductAttention(torch.nn.Module):
    """Constructor and forward keywords as in ``transformer_engine.pytorch.DotProductAttention``
    (the subset a caller of the thd path uses; an unknown keyword is a TypeError, as there)."""

    instances: list[_DotProductAttention] = []
    release: tuple[int, int] = (2, 2)  # the installed fake's version, set by the installer

    def __init__(
        self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
        qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False,
        tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
        attention_type="self", softmax_scale=None,
    ):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = kv_channels  # an int, or (key, value) head dims
        self.k_channels, self.v_channels = (
            kv_channels if isinstance(kv_channels, tuple) else (kv_channels, kv_channels))
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        assert num_attention_heads % self.num_gqa_groups == 0, (
            "The number of attention heads must be divisible by the number of GQA groups"
        )
        self.attention_dropout = attention_dropout
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type.replace(",", "_")
        assert tp_size == 1 and attention_type == "self"
        self.softmax_scale = self.k_channels**-0.5 if softmax_scale is None else softmax_scale
        type(self).instances.append(self)

    def forward(
        self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
        cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None,
        window_size=None, checkpoint_core_attention=False, core_attention_bias_type="no_bias",
        core_attention_bias=None, alibi_slopes=None,
    ):
        q, k, v = query_layer, key_layer, value_layer
        _check_qkv(q, k, v, v_head_dim=self.v_channels)
        assert q.dtype in (torch.float16, torch.bfloat16), f"TE has no {q.dtype} THD kernel"
        assert q.size(-1) <= 256, "no TE THD kernel for head dims above 256"
        assert q.size(1) == self.num_attention_heads, "q must have num_attention_heads heads"
        assert k.size(1) == self.num_gqa_groups, "k/v must have num_gqa_groups heads"
        assert q.size(-1) == self.k_channels, "q/k head dim must equal kv_channels (or its [0])"
        assert self.attention_dropout == 0.0, "expected attention_dropout=0.0"
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        assert attn_mask_type in _TE_MASK_TYPES, f"unknown attn_mask_type {attn_mask_type!r}"
        assert qkv_format == "thd", f"expected qkv_format='thd', got {qkv_format!r}"
        assert attn_mask_type == "padding_causal_bottom_right", (
            f"expected attn_mask_type='padding_causal_bottom_right', got {attn_mask_type!r}"
        )
        assert attention_mask is None and alibi_slopes is None
        assert window_size is None or (window_size[0] >= 0 and window_size[1] == 0), (
            f"window_size={window_size}: with a causal mask the band is (left >= 0, 0)"
        )
        assert core_attention_bias_type == "no_bias" and core_attention_bias is None
        assert cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_kv, q, k)
        for bound, cu in ((max_seqlen_q, cu_seqlens_q), (max_seqlen_kv, cu_seqlens_kv)):
            assert bound is None or bound >= int((cu[1:] - cu[:-1]).max())
        if self.release < (2, 2):  # fused_attn.cpp before 2.2: bottom-right needs s % 64 == 0
            assert max_seqlen_q % 64 == 0 and max_seqlen_kv % 64 == 0, (
                "No dot product attention backend is available for the provided inputs")
        out = _segment_attention(
            q, k, v, cu_seqlens_q.tolist(), cu_seqlens_kv.tolist(), self.softmax_scale,
            None if window_size is None else window_size[0],
        )
        return out.view(*out.shape[:-2], -1)  # thd output: [t, h*dv]


def install_transformer_engine(monkeypatch: pytest.MonkeyPatch, version: str = "2.2.0",
                               cudnn: tuple[int, int, int] = (9, 10, 0),
                               ) -> type[_DotProductAttention]:
    """Fake ``transformer_engine`` (``__version__`` = ``version``, cuDNN ``cudnn``) and
    ``transformer_engine.pytorch`` with its fused-attention functions
    (:class:`_FusedAttn`, as ``DotProductAttention.fused``); returns the
    ``DotProductAttention`` class, whose ``instances`` lists the modules built in this test.
    Before 2.2 the fake, like TE's FusedAttention, takes bottom-right THD segments only when
    the longest are multiples of 64."""
    release = tuple(int(n) for n in version.split(".")[:2])
    fused = _FusedAttn(release, cudnn)
    cls = type("DotProductAttention", (_DotProductAttention,), {"instances": [],
                                                                 "release": release,
                                                                 "fused": fused})
    package = _module("transformer_engine", package=True)
    package.__version__ = version
    package.pytorch = _module("transformer_engine.pytorch", package=True)
    package.pytorch.DotProductAttention = cls
    extensions = _module("transformer_engine.pytorch.cpp_extensions", package=True)
    extensions.fused_attn = _module("transformer_engine.pytorch.cpp_extensions.fused_attn")
    extensions.fused_attn.FusedAttnBackend = {name: name for name in (
        "F16_max512_seqlen", "F16_arbitrary_seqlen", "FP8", "No_Backend")}
    extensions.fused_attn.fused_attn_fwd = fused.fused_attn_fwd
    extensions.fused_attn.fused_attn_bwd = (
        fused.fused_attn_bwd if release <= (2, 12) else fused.fused_attn_bwd_without_dqkv_dtype)
    constants = _module("transformer_engine.pytorch.constants")
    constants.TE_DType = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16"}
    utils = _module("transformer_engine.pytorch.utils")
    utils.get_cudnn_version = lambda: cudnn
    for module in (package, package.pytorch, extensions, extensions.fused_attn, constants,
                   utils):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return cls


class _FusedAttn:
    """``transformer_engine.pytorch.cpp_extensions.fused_attn``'s ``fused_attn_fwd`` and
    ``fused_attn_bwd`` as their docstrings (2.2 to 2.12, and main without ``dqkv_dtype``) and
    TE's context-parallel attention (their caller) state them, on the THD path this project
    calls: ``qkv_layout="thd_thd_thd"``, ``attn_mask_type`` ``"padding"`` (every key of a
    segment, which may hold no query) or ``"padding_causal_bottom_right"`` with ``window_size
    (left, 0)``, the cuDNN backend; ``aux_ctx_tensors = [softmax_stats, rng_state]``, the stats
    the rows' natural-log softmax denominators, float32, ``[t, h, 1]`` from cuDNN 9.6 and
    ``[b, h, max_seqlen_q, 1]`` before. Keywords are checked against the documented names."""

    def __init__(self, release, cudnn):
        self.release, self.cudnn = release, cudnn
        self.calls: list[dict] = []
        self.backward_calls: list[dict] = []

    def _common(self, q, k, v, call):
        assert call["fused_attention_backend"] == "F16_arbitrary_seqlen"
        assert call["qkv_layout"] == "thd_thd_thd" and call["dropout"] == 0.0
        assert call["fake_dtype"] == q.dtype
        assert q.dtype in (torch.float16, torch.bfloat16), f"no {q.dtype} fused THD kernel"
        assert q.dim() == k.dim() == v.dim() == 3 and k.shape[:-1] == v.shape[:-1]
        assert q.size(-1) == k.size(-1) and q.size(1) % k.size(1) == 0
        mask = call["attn_mask_type"]
        assert mask in ("padding", "padding_causal_bottom_right"), mask
        left, right = call["window_size"]
        causal = mask != "padding"
        assert (left, right) == (-1, -1) or (causal and left >= 0 and right == 0)
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            assert torch.equal(call[name], call[f"{name}_padded"])
        _check_cu_seqlens(call["cu_seqlens_q"], call["cu_seqlens_kv"], q, k)
        bounds_q, bounds_k = call["cu_seqlens_q"].tolist(), call["cu_seqlens_kv"].tolist()
        assert call["max_seqlen_q"] >= max(np.diff(bounds_q), default=0)
        return bounds_q, bounds_k, (None if left < 0 else left), causal

    def fused_attn_fwd(self, *, is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q,
                       cu_seqlens_kv, q, k, v, fake_dtype, fused_attention_backend,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, attn_scale=None,
                       dropout=0.0, qkv_layout="sbh3d", attn_mask_type="padding",
                       window_size=(-1, -1)):
        call = dict(locals())
        del call["self"]
        assert is_training
        bounds_q, bounds_k, left, causal = self._common(q, k, v, call)
        self.calls.append(call)
        out, lse = _segment_attention(q, k, v, bounds_q, bounds_k, attn_scale, left, causal,
                                      with_lse=True)
        return out, [self._stats(lse, bounds_q, max_seqlen_q),
                     torch.zeros(2, dtype=torch.int64)]

    def _stats(self, lse, bounds_q, max_seqlen_q):
        if self.cudnn >= (9, 6, 0):
            return lse.t().contiguous()[..., None]
        stats = torch.full((len(bounds_q) - 1, lse.size(0), max_seqlen_q, 1), float("nan"))
        for i, (qs, qe) in enumerate(zip(bounds_q[:-1], bounds_q[1:])):
            stats[i, :, : qe - qs, 0] = lse[:, qs:qe]
        return stats

    def _lse(self, stats, bounds_q):
        if self.cudnn >= (9, 6, 0):
            assert stats.shape[1:] == (stats.size(1), 1) and stats.size(0) == bounds_q[-1]
            return stats[..., 0].t()
        return torch.cat([stats[i, :, : qe - qs, 0] for i, (qs, qe)
                          in enumerate(zip(bounds_q[:-1], bounds_q[1:]))], 1)

    def fused_attn_bwd(self, *, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k,
                       v, o, d_o, fake_dtype, dqkv_dtype, aux_ctx_tensors,
                       fused_attention_backend, cu_seqlens_q_padded=None,
                       cu_seqlens_kv_padded=None, attn_scale=None, dropout=0.0,
                       qkv_layout="sbh3d", attn_mask_type="padding", window_size=(-1, -1),
                       deterministic=False):
        assert dqkv_dtype == {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16"}[q.dtype]
        return self.fused_attn_bwd_without_dqkv_dtype(**{
            name: value for name, value in locals().items() if name not in ("self",
                                                                            "dqkv_dtype")})

    def fused_attn_bwd_without_dqkv_dtype(
            self, *, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
            fake_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None, attn_scale=None, dropout=0.0, qkv_layout="sbh3d",
            attn_mask_type="padding", window_size=(-1, -1), deterministic=False):
        call = dict(locals())
        del call["self"]
        bounds_q, bounds_k, left, causal = self._common(q, k, v, call)
        stats, rng_state = aux_ctx_tensors
        assert o.shape[:-1] == q.shape[:-1] and d_o.shape == o.shape
        self.backward_calls.append(call)
        grads = _segment_attention_backward(d_o, q, k, v, o, self._lse(stats, bounds_q),
                                            bounds_q, bounds_k, attn_scale, left, causal)
        return (*(g.to(q.dtype) for g in grads), None)


# ---------------------------------------------------------------- torch_npu


class _TorchNpu:
    def __init__(self):
        self.calls: list[dict] = []
        self.backward_calls: list[dict] = []

    def npu_fusion_attention(
        self, query, key, value, head_num, input_layout, pse=None, padding_mask=None,
        atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
        next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
        actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
    ):
        self.calls.append(dict(atten_mask=atten_mask, actual_seq_qlen=actual_seq_qlen,
                               actual_seq_kvlen=actual_seq_kvlen, scale=scale,
                               sparse_mode=sparse_mode, pre_tockens=pre_tockens,
                               next_tockens=next_tockens))
        left, causal = self._check(query, key, value, head_num, input_layout, atten_mask,
                                   keep_prob, pse, padding_mask, prefix, actual_seq_qlen,
                                   actual_seq_kvlen, sparse_mode, pre_tockens, next_tockens)
        self.calls[-1]["segments"] = len(actual_seq_qlen)
        bounds = [0, *actual_seq_qlen], [0, *actual_seq_kvlen]
        out, maxes, sums = [], [], []
        for qs, qe, ks, ke, allowed in _segment_masks(*bounds, left, causal):
            qi, ki, vi = _segment_tensors(query, key, value, qs, qe, ks, ke)
            scores = (torch.einsum("qhd,khd->hqk", qi, ki) * scale).masked_fill(~allowed,
                                                                               float("-inf"))
            row_max = scores.amax(-1)  # [h, s]
            probs = (scores - row_max[..., None]).exp()
            maxes.append(row_max)
            sums.append(probs.sum(-1))
            out.append(torch.einsum("hqk,khd->qhd", probs / probs.sum(-1, keepdim=True), vi))
        # documented outputs: attention_out, softmax_max, softmax_sum, reserved, seed, offset,
        # numel; the softmax statistics float32 [T, N, 8], 8 equal lanes, laid out segment by
        # segment as [N, s_b, 8] (the layout MindSpeed's TND ring attention reads)
        return (torch.cat(out).to(query.dtype), _softmax_layout(maxes, query),
                _softmax_layout(sums, query), torch.empty(0), 0, 0, 0)

    def npu_fusion_attention_grad(
        self, query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
        atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
        attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
        next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
        sync=False,
    ):
        """The documented backward: ``P = exp(scale * q.k - softmax_max) / softmax_sum``
        (statistics in the forward's layout), ``D = rowsum(dy * attention_in)``; returns
        ``(dq, dk, dv, dpse)``."""
        self.backward_calls.append(dict(sparse_mode=sparse_mode, segments=len(actual_seq_qlen),
                                        pre_tockens=pre_tockens))
        left, causal = self._check(query, key, value, head_num, input_layout, atten_mask,
                                   keep_prob, pse, padding_mask, prefix, actual_seq_qlen,
                                   actual_seq_kvlen, sparse_mode, pre_tockens, next_tockens)
        for name, x, like in (("dy", dy, query), ("attention_in", attention_in, query)):
            assert x is not None and x.shape == like.shape and x.dtype == like.dtype, (
                f"{name} must be shaped and typed like query")
        stats_shape = (query.size(0), head_num, 8)
        for name, x in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
            assert x is not None and x.shape == stats_shape and x.dtype == torch.float32, (
                f"{name} must be float32 {stats_shape} (TND), as the forward returns it")
            assert bool((x == x[..., :1]).all()), f"{name}'s 8 lanes must repeat one value"
        assert softmax_in is None and isinstance(scale_value, float)
        bounds_q = [0, *actual_seq_qlen]
        lse = (_softmax_rows_of(softmax_max, bounds_q).double()
               + _softmax_rows_of(softmax_sum, bounds_q).double().log())
        dq, dk, dv = _segment_attention_backward(
            dy, query, key, value, attention_in, lse, bounds_q, [0, *actual_seq_kvlen],
            scale_value, left, causal)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0)

    @staticmethod
    def _check(query, key, value, head_num, input_layout, atten_mask, keep_prob, pse,
               padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
               pre_tockens, next_tockens):
        """The documented arguments of both directions; ``(left, causal)`` of the mask."""
        _check_qkv(query, key, value)
        assert input_layout == "TND", f"expected input_layout='TND', got {input_layout!r}"
        assert head_num == query.size(1), "head_num must be the number of query heads"
        assert sparse_mode in (0, 3, 4), (
            f"expected sparse_mode=3 (rightDownCausal), 4 (band) or 0 without a mask (every "
            f"key), got {sparse_mode}"
        )
        if sparse_mode == 0:  # atten_mask None: computed in full, tockens ignored
            assert atten_mask is None, "this fake models sparse_mode 0 without a mask only"
        else:
            # band (4): pre_tockens keys before the diagonal, next_tockens after it; aligned
            # bottom-right per segment in TND, like mode 3
            assert sparse_mode == 3 or (0 <= pre_tockens and next_tockens == 0), (
                "a causal band is pre_tockens >= 0, next_tockens == 0"
            )
            assert isinstance(atten_mask, torch.Tensor) and atten_mask.dtype == torch.bool
            assert atten_mask.device == query.device, "atten_mask must be on the device"
            assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1).to(
                atten_mask.device)), "sparse_mode 3 / 4 take the compressed 2048x2048 causal mask"
        assert keep_prob == 1.0, "expected keep_prob=1.0"
        assert pse is None and padding_mask is None and prefix is None
        for name, lens, x in (("actual_seq_qlen", actual_seq_qlen, query),
                              ("actual_seq_kvlen", actual_seq_kvlen, key)):
            assert isinstance(lens, list) and all(type(n) is int for n in lens), (
                f"{name} must be a host list of Python ints, got {type(lens).__name__}"
            )
            # a segment may hold no query (documented), never one without keys
            assert lens and (lens[0] != 0 or name == "actual_seq_qlen" and sparse_mode == 0), (
                f"{name} holds cumulative ends without a leading 0"
            )
            assert lens == sorted(lens) and lens[-1] == x.size(0), (
                f"{name} must be cumulative and end at the token count"
            )
        assert len(actual_seq_qlen) == len(actual_seq_kvlen), "one length per segment, q and kv"
        assert len(actual_seq_qlen) <= 1024, "varlen: actual_seq_qlen holds at most 1K segments"
        assert 1 <= query.size(-1) <= 768, "head dim D must be 1~768"
        assert 1 <= head_num <= 256, "Nq must be 1~256"
        return (pre_tockens if sparse_mode == 4 else None), sparse_mode != 0


def _softmax_layout(per_segment, query):
    """Per-segment statistics ``[h, s_b]`` -> the kernel's ``[T, N, 8]`` float32: segment by
    segment, each as ``[N, s_b, 8]`` in memory."""
    flat = [x[..., None].expand(-1, -1, 8).reshape(-1, 8) for x in per_segment]
    return torch.cat(flat).float().view(query.size(0), query.size(1), 8)


def _softmax_rows_of(stats, bounds_q):
    """The kernel's ``[T, N, 8]`` statistics -> ``[h, T]`` in token order (lane 0)."""
    heads, rows, at = stats.size(1), [], 0
    flat = stats.reshape(-1, 8)[:, 0]
    for qs, qe in zip(bounds_q[:-1], bounds_q[1:]):
        rows.append(flat[at: at + (qe - qs) * heads].view(heads, qe - qs))
        at += (qe - qs) * heads
    return torch.cat(rows, 1)


def install_torch_npu(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A fake ``torch_npu``; its ``calls`` list records each forward call's mask, lengths and
    scale, ``backward_calls`` each ``npu_fusion_attention_grad``'s mask mode and segments."""
    kernel = _TorchNpu()
    module = _module("torch_npu", package=True)
    module.npu_fusion_attention = kernel.npu_fusion_attention
    module.npu_fusion_attention_grad = kernel.npu_fusion_attention_grad
    module.calls, module.backward_calls = kernel.calls, kernel.backward_calls
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None):
    """FlexAttention's documented attention, dense and differentiable (autograd through
    einsum): the pairs the block mask's ``mask_mod`` admits, evaluated on every (query, key)
    pair of the full grid, nothing else."""
    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None and kernel_options is None and not return_lse
    assert query.dim() == key.dim() == value.dim() == 4 and query.size(0) == 1
    heads, heads_k = query.size(1), key.size(1)
    assert enable_gqa or heads == heads_k
    assert heads % heads_k == 0 and key.size(-1) == query.size(-1)
    group = heads // heads_k
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scale = query.size(-1) ** -0.5 if scale is None else scale
    allowed = create_mask(block_mask.mask_mod, 1, 1, query.size(2), key.size(2),
                          device=query.device)[0, 0]
    scores = torch.einsum("bhqd,bhkd->bhqk", query, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhqk,bhkd->bhqd", (scores - lse[..., None]).exp(), v)
    assert return_aux is not None and return_aux.lse
    return out, types.SimpleNamespace(lse=lse.detach())
