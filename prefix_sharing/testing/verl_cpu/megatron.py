"""verl's Megatron engine (``strategy: megatron``) inside the CPU trainer: test support.

What the FSDP engines do not need and the Megatron engine does, in every Ray worker that builds
one:

- megatron-core's hard-coded CUDA redirected to the CPU
  (:func:`prefix_sharing.megatron_ext.cpu_support.enable_cpu_megatron`), in the thread that runs
  the engine (its redirection of ``device="cuda"`` is a per-thread torch function mode);
- ``megatron.dtype: float32`` let through verl's config check (``McoreEngineConfig`` asserts
  bf16 or fp16; the engine itself builds an fp32 model from it): the trainer tests compare in
  fp32, as the FSDP ones do;
- a stand-in for Transformer Engine at the one place verl's vanilla-mbridge route asks for it:
  ``LLMBridge._get_transformer_layer_spec`` builds megatron-core's TE layer spec, whose modules
  need TE's CUDA kernels. The stand-in answers megatron-core's **local** spec (its own linear
  layers, norms and MLP), with one change TE would have made: the core attention runs THD packed
  sequences (``PackedDotProductAttention``), which megatron's local ``DotProductAttention``
  refuses. The model trained is megatron-core's local GPT; with sharing on, the sharing layer
  spec replaces that core attention as it replaces TE's.

Nothing here is imported by the library.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def install() -> None:
    """Idempotent; a no-op without mbridge (0.9.1's default route is Megatron-Bridge, which the
    trainer tests do not take)."""
    try:
        from mbridge.core import llm_bridge
    except ImportError:
        return
    if getattr(llm_bridge.LLMBridge._get_transformer_layer_spec, "_cpu_shim", False):
        return
    llm_bridge.LLMBridge._get_transformer_layer_spec = _local_layer_spec
    _name_local_norms_as_te(llm_bridge.LLMBridge)
    _allow_fp32_engines()
    _run_engine_on_cpu()


# The local spec's pre-attention and pre-MLP norms, and the TE spec's names for the same weights
# (TE fuses each norm into the linear layer after it), which mbridge's name maps know.
_TE_NORM_NAMES = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                  ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def _name_local_norms_as_te(bridge_class: type) -> None:
    """mbridge converts weights by megatron name, for the TE spec's names only."""
    to_hf = bridge_class._weight_name_mapping_mcore_to_hf

    @functools.wraps(to_hf)
    def local_to_hf(self, name: str) -> list[str]:
        for local, te in _TE_NORM_NAMES.items():
            if name.endswith(local):
                name = name[: -len(local)] + te
        return to_hf(self, name)

    bridge_class._weight_name_mapping_mcore_to_hf = local_to_hf


def _allow_fp32_engines() -> None:
    from verl.workers.config import engine

    # verl's own class (prefix-sharing's config hook may have put a subclass in its place, whose
    # check calls this one's)
    config_class = getattr(engine.McoreEngineConfig, "_prefix_sharing_base",
                           engine.McoreEngineConfig)
    check = config_class.__post_init__

    @functools.wraps(check)
    def post_init(self) -> None:
        fp32 = self.dtype == "float32"
        if fp32:  # verl's configs freeze their fields once built
            object.__setattr__(self, "dtype", "bfloat16")
        check(self)
        if fp32:
            object.__setattr__(self, "dtype", "float32")

    config_class.__post_init__ = post_init


def _local_layer_spec(self, vp_stage: int | None = None):
    """mbridge's ``_get_transformer_layer_spec`` with megatron-core's local modules (see the
    module doc)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    assert self.config.normalization == "RMSNorm", "only RMSNorm is supported for now"  # as mbridge
    spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                      vp_stage=vp_stage)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = packed_dot_product_attention()
    return spec


_local_layer_spec._cpu_shim = True


def _run_engine_on_cpu() -> None:
    """Every method of verl's Megatron engines runs with megatron-core redirected to the CPU in
    its calling thread (Ray may call an actor's methods from more than one thread). Nothing
    changes in a process that builds no Megatron engine (the FSDP trainer runs)."""
    from verl.workers.engine.megatron import transformer_impl

    cls = transformer_impl.MegatronEngine
    for name, method in list(vars(cls).items()):
        if inspect.isfunction(method) and not name.startswith("__"):  # not static, class methods
            setattr(cls, name, _on_cpu(method))


def _on_cpu(method):
    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any):
        _megatron_on_cpu()
        return method(*args, **kwargs)

    return wrapped


def _megatron_on_cpu() -> None:
    """This thread's redirection of ``device="cuda"``, and process-wide once the CPU's
    ``Module.cuda``."""
    from prefix_sharing.megatron_ext.cpu_support import enable_cpu_megatron

    enable_cpu_megatron()
    _modules_stay_on_cpu()


@functools.cache
def _modules_stay_on_cpu() -> None:
    """mbridge's get_model moves every model chunk with ``.cuda(torch.cuda.current_device())``
    (as Megatron-LM's does): the chunks are built on the CPU, where they stay."""
    torch.nn.Module.cuda = lambda self, device=None: self


@functools.cache
def packed_dot_product_attention() -> type:
    """``PackedDotProductAttention`` (defined on first use: it subclasses megatron's)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        """megatron-core's local core attention, plus THD packed sequences with Transformer
        Engine's semantics: segment i is rows ``cu_seqlens_q_padded[i]`` onward (or
        ``cu_seqlens_q[i]`` without padding), ``cu_seqlens_q[i+1] - cu_seqlens_q[i]`` of them,
        attending causally within itself; padding rows give zeros. ``(t, heads, dim)`` in,
        ``(t, heads * dim)`` out."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias, packed_seq_params)
            lengths = (packed_seq_params.cu_seqlens_q[1:]
                       - packed_seq_params.cu_seqlens_q[:-1]).tolist()
            starts = packed_seq_params.cu_seqlens_q_padded
            starts = (starts if starts is not None else packed_seq_params.cu_seqlens_q).tolist()
            groups = query.shape[1] // key.shape[1]
            out = query.new_zeros(query.shape)
            for start, length in zip(starts, lengths):
                rows = slice(start, start + length)
                q = query[rows].transpose(0, 1)
                k = key[rows].repeat_interleave(groups, dim=1).transpose(0, 1)
                v = value[rows].repeat_interleave(groups, dim=1).transpose(0, 1)
                attended = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale)
                out = out.index_copy(0, torch.arange(start, start + length),
                                     attended.transpose(0, 1))
            return out.reshape(out.shape[0], -1)

    return PackedDotProductAttention
