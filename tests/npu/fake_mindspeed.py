"""A stand-in for MindSpeed that patches megatron-core the way MindSpeed does, on CPU.

Written from MindSpeed's public source (github.com/Ascend/MindSpeed, branch ``core_r0.16.0``,
commit e4772499), not copied from it; each piece names the file it follows:

- ``mindspeed/patch_utils.py`` (``Patch``, ``MindSpeedPatchesManager``): ``register_patch(name,
  new)`` records a replacement of the dotted ``name`` (a module attribute or a class attribute);
  a function named ``*wrapper``/``*decorator`` is stacked on top instead, and replacing one
  target twice raises unless ``force_patch``. ``apply_patches`` sets the result on the target's
  owner *and on every loaded module holding the object it replaces*. ``remove_patches`` puts the
  originals back wherever the patched object is and forgets every replacement and wrapper.
- ``mindspeed/features_manager/feature.py``, ``features_manager.py``: a feature registers its
  patches when ``is_need_apply(args)``; optimization level 0 means always.
- ``mindspeed/megatron_adaptor.py``: importing it applies every feature's patches;
  ``repatch(args)`` removes all patches, copies ``args`` into the full args and applies the
  features again.
- The features (each registers what the named file registers, with a CPU stand-in):
  ``features_manager/transformer/flash_attention/fusion_attention_v1_feature.py`` replaces
  ``DotProductAttention.forward`` with ``core/transformer/flash_attention/flash_attention/
  adaptor.py::dot_product_attention_forward_impl`` (TND from ``packed_seq_params``'s cu_seqlens,
  ``sparse_mode`` 2 - top-left causal - as ``generate_mask_feature.py`` forces);
  ``features_manager/fusions/fused_rope.py`` replaces ``rope_utils._apply_rotary_pos_emb_bshd``
  (``npu_rotary_position_embedding``: the same rotation, computed here as a complex product) and
  ``rope_utils.apply_rotary_pos_emb`` (bshd -> the fused rotary; THD -> a segment-wise rotary that
  restarts positions at 0 per segment, as the fused THD kernels do);
  ``features_manager/megatron_basic/transformer_engine_basic.py`` replaces the class
  ``megatron.core.extensions.transformer_engine.TEDotProductAttention``;
  ``features_manager/context_parallel/context_parallel_feature.py``, with a context-parallel
  size above 1, replaces the class ``DotProductAttention`` with its CP class
  (``core/context_parallel/adaptor.py::MindSpeedCPDotProductAttention``: megatron's class built
  as if CP were 1, its forward the ``--context-parallel-algo`` attention)
  and ``rotary_pos_embedding.get_pos_emb_on_this_cp_rank`` (its RoPE table slicing). Not
  emulated: its ``Attention.__init__`` wrapper (Ulysses algorithms only, which the prefix-sharing
  feature refuses) and its ``initialize_model_parallel`` wrapper (extra process groups).

``CALLS`` counts the stand-ins' calls, so a test can show the patches were in force.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable

import pytest
import torch

__all__ = ["CALLS", "install"]

CALLS: collections.Counter = collections.Counter()
_MODULE_PREFIX = "mindspeed"


# ----------------------------------------------------------------- patch_utils
class _Patch:
    """One patched name: its original, its replacement, the wrappers stacked on top."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.replacement: Callable | None = None
        self.wrappers: list[Callable] = []
        self.original: Any = None
        self.captured = False
        self.in_place: Any = None  # what apply() put there; None when not applied

    def add(self, new: Callable, force: bool) -> None:
        if getattr(new, "__name__", "").endswith(("wrapper", "decorator")):
            if new not in self.wrappers:
                self.wrappers.append(new)
        elif self.replacement is not None and not force:
            raise RuntimeError(f"the patch of {self.name} exist !")
        else:
            self.replacement = new
        self.in_place = None  # to be (re)applied

    def apply(self) -> None:
        if self.in_place is not None:
            return
        owner, attr = _resolve(self.name)
        current = getattr(owner, attr)
        if not self.captured:
            self.original, self.captured = current, True
        final = self.replacement if self.replacement is not None else self.original
        for wrapper in self.wrappers:
            final = wrapper(final)
        _replace_everywhere(owner, attr, current, final)
        self.in_place = final

    def remove(self) -> None:
        if self.in_place is not None:
            owner, attr = _resolve(self.name)
            _replace_everywhere(owner, attr, self.in_place, self.original)
        self.replacement, self.wrappers, self.in_place = None, [], None


def _resolve(name: str) -> tuple[Any, str]:
    """The object owning the last component of a dotted name, and that component."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ModuleNotFoundError(name)


def _replace_everywhere(owner: Any, attr: str, old: Any, new: Any) -> None:
    """MindSpeed probes every module with ``hasattr``; the module's own namespace here, so a
    lazy module (transformers) is not made to import its submodules."""
    setattr(owner, attr, new)
    for name, module in list(sys.modules.items()):
        if module is None or name.startswith(_MODULE_PREFIX):
            continue
        if vars(module).get(attr) is old and old is not None:
            setattr(module, attr, new)


class MindSpeedPatchesManager:
    patches_info: dict[str, _Patch] = {}

    @staticmethod
    def register_patch(orig_func_name: str, new_func: Callable | None = None,
                       force_patch: bool = False, create_dummy: bool = False) -> None:
        patches = MindSpeedPatchesManager.patches_info
        patches.setdefault(orig_func_name, _Patch(orig_func_name)).add(new_func, force_patch)

    @staticmethod
    def apply_patches() -> None:
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply()

    @staticmethod
    def remove_patches() -> None:
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.remove()


# ----------------------------------------------------------------- features
class MindSpeedFeature:
    def __init__(self, feature_name: str, optimization_level: int = 2) -> None:
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        self.default_patches = optimization_level == 0

    def is_need_apply(self, args: Any) -> bool:
        return bool((self.optimization_level <= args.optimization_level
                     and getattr(args, self.feature_name, None)) or self.default_patches)

    def pre_register_patches(self, patch_manager: Any, args: Any) -> None:
        pass

    def register_patches(self, patch_manager: Any, args: Any) -> None:
        pass

    def validate_args(self, args: Any) -> None:
        pass


class MindSpeedFeaturesManager:
    FEATURES_LIST: list[MindSpeedFeature] = []

    @classmethod
    def apply_features_pre_patches(cls, args: Any) -> None:
        for feature in cls.FEATURES_LIST:
            if feature.is_need_apply(args):
                feature.pre_register_patches(MindSpeedPatchesManager, args)
        MindSpeedPatchesManager.apply_patches()

    @classmethod
    def apply_features_patches(cls, args: Any) -> None:
        for feature in cls.FEATURES_LIST:
            if feature.is_need_apply(args):
                feature.register_patches(MindSpeedPatchesManager, args)
        MindSpeedPatchesManager.apply_patches()

    @classmethod
    def remove_patches(cls) -> None:
        MindSpeedPatchesManager.remove_patches()


class _FusionAttention(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("use-flash-attn", optimization_level=0)

    def register_patches(self, patch_manager: Any, args: Any) -> None:
        patch_manager.register_patch(
            "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
            fused_attention_forward,
        )


class _FusedRope(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("use-fused-rotary-pos-emb", optimization_level=0)

    def register_patches(self, patch_manager: Any, args: Any) -> None:
        rope = "megatron.core.models.common.embeddings.rope_utils"
        patch_manager.register_patch(f"{rope}._apply_rotary_pos_emb_bshd", fused_rotary_bshd)
        patch_manager.register_patch(f"{rope}.apply_rotary_pos_emb", fused_apply_rotary_pos_emb)


class TEDotProductAttentionStandIn(torch.nn.Module):
    """Where MindSpeed puts its own TEDotProductAttention class."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("MindSpeed's TEDotProductAttention stand-in was called")


class _TransformerEngineBasic(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("transformer-engine-basic", optimization_level=0)

    def register_patches(self, patch_manager: Any, args: Any) -> None:
        patch_manager.register_patch(
            "megatron.core.extensions.transformer_engine.TEDotProductAttention",
            TEDotProductAttentionStandIn,
        )


class _ContextParallel(MindSpeedFeature):
    def __init__(self) -> None:
        super().__init__("context-parallel-size")

    def register_patches(self, patch_manager: Any, args: Any) -> None:
        if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
            patch_manager.register_patch(
                "megatron.core.transformer.dot_product_attention.DotProductAttention",
                cp_attention_class())
            patch_manager.register_patch(
                "megatron.core.models.common.embeddings.rotary_pos_embedding."
                "get_pos_emb_on_this_cp_rank", cp_rotary_slice)


@functools.cache
def cp_attention_class() -> type:
    """MindSpeed's ``MindSpeedCPDotProductAttention`` stand-in, on megatron's own class."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MindSpeedCPDotProductAttention(DotProductAttention):
        def __init__(self, config, *args: Any, **kwargs: Any) -> None:
            cp = config.context_parallel_size  # megatron's class asserts CP == 1
            config.context_parallel_size = 1
            super().__init__(config, *args, **kwargs)
            config.context_parallel_size = cp

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            CALLS["cp_attention"] += 1
            raise AssertionError("MindSpeed's context-parallel attention stand-in was called")

    MindSpeedCPDotProductAttention.__module__ = "mindspeed.core.context_parallel.adaptor"
    return MindSpeedCPDotProductAttention


def cp_rotary_slice(pos_emb, seq_dim, *args: Any) -> Any:
    """MindSpeed's ``get_pos_emb_on_this_cp_rank``: megatron calls it for non-packed input."""
    CALLS["cp_rotary_slice"] += 1
    raise AssertionError("MindSpeed's CP RoPE slicing stand-in was called")


# ----------------------------------------------------------------- kernels' stand-ins
def fused_attention_forward(self, query, key, value, attention_mask, attn_mask_type=None,
                            attention_bias=None, packed_seq_params=None):
    """MindSpeed's fused attention forward: sbhd causal, or TND with sparse_mode 2 (each
    segment's causal mask aligned top-left, as MindSpeed's flash attention allows)."""
    CALLS["attention"] += 1
    assert attention_bias is None
    if packed_seq_params is None:  # [s, b, h, d] -> [s, b, h*d]
        out = _causal(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                      self.softmax_scale, top_left=True).transpose(0, 1)
        return out.reshape(out.size(0), out.size(1), -1)
    bounds_q = packed_seq_params.cu_seqlens_q.tolist()
    bounds_k = packed_seq_params.cu_seqlens_kv.tolist()
    out = [
        _causal(query[qs:qe][None], key[ks:ke][None], value[ks:ke][None], self.softmax_scale,
                top_left=True)[0]
        for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:])
    ]
    out = torch.cat(out)
    return out.reshape(out.size(0), -1)


def _causal(q, k, v, scale, top_left):
    """[b, s, h, d] queries over [b, L, hk, d] keys; causal from the top-left corner."""
    group = q.size(2) // k.size(2)
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s, L = q.size(1), k.size(1)
    shift = 0 if top_left else L - s
    allowed = torch.arange(L)[None, :] <= torch.arange(s)[:, None] + shift
    probs = scores.masked_fill(~allowed.to(q.device), float("-inf")).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def fused_rotary_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
    """The rotation of ``rope_utils._apply_rotary_pos_emb_bshd``, as a complex product."""
    CALLS["rope_bshd"] += 1
    assert not rotary_interleaved and not multi_latent_attention
    rot = freqs.size(-1)
    t, rest = t[..., :rot], t[..., rot:]
    half = rot // 2
    angle = freqs[..., :half].float()
    turn = torch.polar(torch.full_like(angle, float(mscale)), angle)
    pairs = torch.complex(t[..., :half].float(), t[..., half:].float()) * turn
    rotated = torch.cat([pairs.real, pairs.imag], dim=-1).to(t.dtype)
    return torch.cat([rotated, rest], dim=-1)


def fused_apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
    """MindSpeed's router: bshd to the (patched) bshd rotary; THD segment by segment, every
    segment's positions starting at 0."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    if cu_seqlens is None:
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)
    CALLS["rope_thd"] += 1
    bounds = cu_seqlens.tolist()
    return torch.cat([
        rope_utils._apply_rotary_pos_emb_bshd(t[s:e].unsqueeze(1), freqs[: e - s], mscale=mscale)
        .squeeze(1)
        for s, e in zip(bounds[:-1], bounds[1:])
    ])


# ----------------------------------------------------------------- the package
FULL_ARGS = argparse.Namespace(optimization_level=2)


def _patch_features() -> None:
    MindSpeedFeaturesManager.FEATURES_LIST[:] = [
        _TransformerEngineBasic(), _FusionAttention(), _FusedRope(), _ContextParallel(),
    ]
    MindSpeedFeaturesManager.apply_features_pre_patches(FULL_ARGS)
    MindSpeedFeaturesManager.apply_features_patches(FULL_ARGS)


def repatch(args: dict) -> None:
    MindSpeedFeaturesManager.remove_patches()
    for key, value in args.items():
        setattr(FULL_ARGS, key, value)
    MindSpeedFeaturesManager.apply_features_pre_patches(FULL_ARGS)
    MindSpeedFeaturesManager.apply_features_patches(FULL_ARGS)


class _AdaptorLoader(importlib.abc.Loader):
    """``import mindspeed.megatron_adaptor`` patches megatron-core, as the real one does."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.repatch = repatch
        module.patch_features = _patch_features
        _patch_features()


class _AdaptorFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mindspeed.megatron_adaptor":
            return importlib.machinery.ModuleSpec(fullname, _AdaptorLoader())
        return None


def _module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    return module


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts the fake ``mindspeed`` package in place; ``import mindspeed.megatron_adaptor`` then
    patches megatron-core. Patches outlive ``monkeypatch``: use it in a spawned rank only."""
    modules = {
        "mindspeed": _module("mindspeed", package=True),
        "mindspeed.patch_utils": _module("mindspeed.patch_utils",
                                         MindSpeedPatchesManager=MindSpeedPatchesManager),
        "mindspeed.args_utils": _module("mindspeed.args_utils", get_full_args=lambda: FULL_ARGS),
        "mindspeed.features_manager": _module("mindspeed.features_manager", package=True,
                                              MindSpeedFeature=MindSpeedFeature,
                                              MindSpeedFeaturesManager=MindSpeedFeaturesManager),
        "mindspeed.features_manager.feature": _module("mindspeed.features_manager.feature",
                                                      MindSpeedFeature=MindSpeedFeature),
        "mindspeed.features_manager.features_manager": _module(
            "mindspeed.features_manager.features_manager",
            MindSpeedFeaturesManager=MindSpeedFeaturesManager),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys, "meta_path", [_AdaptorFinder(), *sys.meta_path])
