"""The transformers attention function that reads the sharing plan: K/V injection in HF models.

Registered under :data:`ATTENTION_NAME` through ``transformers.AttentionInterface``. The model's
forward carries the plan as a keyword (``sharing_plan=``), which transformers hands unchanged to
every layer's attention function; each layer then gathers its provider K/V through the plan and
runs the project's varlen kernel (torch on CPU, flash-attn on CUDA, the fused kernel on Ascend).

No mask function is registered on purpose: for an attention name unknown to
``AttentionMaskInterface``, transformers skips mask creation and passes ``attention_mask=None``.
The plan's segments already say which keys each query sees, and the ``(T, T)`` mask that
``eager``/``sdpa`` would build over the flat layout (``T`` can be tens of thousands) is never
materialised.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..attention import prefix_attention
from ..plan import SharingPlan
from ..refusals import refuse
from .ulysses import SPLIT_KWARG as ULYSSES_KWARG
from .ulysses import ulysses_attention

__all__ = ["ATTENTION_NAME", "PLAN_KWARG", "BACKEND_KWARG", "PREFIX_KV_KWARG",
           "register_attention", "prefix_sharing_attention"]

ATTENTION_NAME = "prefix_sharing"
PLAN_KWARG = "sharing_plan"  # the forward keyword carrying the SharingPlan
BACKEND_KWARG = "sharing_backend"  # the forward keyword naming the kernel ("auto" when absent)
# the forward keyword carrying a group's stored K/V across micro-batches (a PrefixKVStack pass)
PREFIX_KV_KWARG = "sharing_prefix_kv"


def register_attention() -> None:
    """Makes ``attn_implementation="prefix_sharing"`` available to every transformers model."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, prefix_sharing_attention)


def prefix_sharing_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of the plan's flat layout, with transformers' attention-function signature.

    Args:
        module: the calling attention layer (read for its sliding window).
        query: ``(1, nheads, T_flat, headdim)``, positions already applied.
        key, value: ``(1, nheads_k, T_flat, headdim)``.
        attention_mask: must be ``None`` (see the module doc; a padding mask has no meaning
            in the flat layout, which holds no padding the plan does not place itself).
        dropout: must be 0: the kernels run without attention dropout.
        scaling: the softmax scale (``headdim ** -0.5`` when ``None``).
        kwargs: the forward's keywords; ``sharing_plan`` is required, ``sharing_backend``
            optional, ``sharing_ulysses`` on a Ulysses rank (:mod:`.ulysses`: ``query``,
            ``key``, ``value`` and the output then hold the rank's rows),
            ``sharing_prefix_kv`` in a micro-batch of a group run across micro-batches (the
            stored K/V its plan's external rows are, read in place; a block records its own:
            :mod:`.cross_steps`); the layer's own
            ``sliding_window`` (a band of that many keys on logical positions) and ``s_aux``
            (gpt-oss's per-head sink logits) are honoured, a ``softcap`` refused.

    Returns:
        ``((1, T_flat, nheads, headdim), None)``: no attention weights are ever built.
    """
    plan = kwargs.get(PLAN_KWARG)
    if not isinstance(plan, SharingPlan):
        raise ValueError(
            f"attn_implementation={ATTENTION_NAME!r} needs the micro-batch's plan: call the model "
            f"with {PLAN_KWARG}=plan (prefix_sharing.fsdp_compat.shared_forward does)"
        )
    if attention_mask is not None:
        raise ValueError(
            f"the {ATTENTION_NAME!r} attention takes no attention_mask: the plan lays out "
            "unpadded sequences; pass sequences to build_plan instead of a padded batch"
        )
    if dropout:
        raise refuse("hf.attention_dropout", f"dropout={dropout}")
    if query.size(0) != 1:
        raise ValueError(f"the flat layout is one row of tokens; got a batch of {query.size(0)}")
    if kwargs.get("softcap") is not None:
        raise refuse("hf.softcapping", f"layer {getattr(module, 'layer_idx', '?')} soft-caps its "
                     f"attention logits (softcap={kwargs['softcap']}, Gemma 2's "
                     "attn_logit_softcapping)")

    # [1, h, T, d] -> [T, h, d]: the varlen kernels' token-major layout
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    prefix_kv = kwargs.get(PREFIX_KV_KWARG)  # a group's blocks across micro-batches
    key_sources = None if prefix_kv is None else partial(prefix_kv.key_sources, module.layer_idx)
    split = kwargs.get(ULYSSES_KWARG)  # a Ulysses rank's rows: the all-to-all goes around it
    if split is not None:
        attend = partial(ulysses_attention, split=split, key_sources=key_sources)
    elif key_sources is not None:  # the blocks' K/V read in place; a block records its own
        stored, k, v = key_sources(k, v)
        attend = partial(prefix_attention, stored=stored)
    else:
        attend = prefix_attention
    out = attend(q, k, v, plan, softmax_scale=scaling, window=_window(module, kwargs),
                 sinks=kwargs.get("s_aux"), backend=kwargs.get(BACKEND_KWARG) or "auto",
                 kernel_cache=_kernel_cache(module))
    return out.unsqueeze(0), None  # [1, T, h, d], as transformers' attention functions return


def _window(module: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The layer's sliding window in keys per query, itself included: transformers' masks let
    query ``i`` read keys ``j > i - sliding_window``, the same count. Layers pass it as a
    keyword (gpt-oss, Gemma 3 / 4) or hold it as an attribute (Qwen2, Mistral)."""
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    return int(window) if window is not None else None


def _kernel_cache(module: torch.nn.Module) -> dict:
    """The layer's own kernel state (Transformer Engine keeps an attention module per layer)."""
    cache = module.__dict__.get("_prefix_sharing_kernel_cache")
    if cache is None:
        cache = module.__dict__["_prefix_sharing_kernel_cache"] = {}
    return cache
