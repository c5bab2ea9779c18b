"""Forward+backward FLOPs of a micro-batch, plain and shared: the physical limit of the saving.

Counted: every linear layer (QKV - or multi-latent attention's down- and up-projections -,
output projection, MLP - or an MoE layer's router, top-k routed experts and shared expert -, LM
head) at 2 FLOPs per multiply-add per computed token, and attention at 2 * heads * (key head dim
+ value head dim) FLOPs per (query, key) pair the causal mask allows (scores and the weighted
sum; on a sliding-window layer, the pairs inside the window). On a Gated DeltaNet hybrid
(``full_attention_every``), each recurrent layer costs per computed token its projections (q, k,
v, output gate z, beta, decay; output), its causal convolution, and the chunked gated delta
rule's products at fla's chunk size 64 (the CPU torch kernels use 32 for plain and shared
steps alike; per value head ``6 K V`` for the state's reads and writes,
``C (5 K + 3 V)`` for the intra-chunk products and triangular solves): linear in the tokens, like
an MLP, so sharing saves it in the token ratio; the attention layers of a hybrid gate their
output (a q projection twice as wide). On a Mamba-2 hybrid (``mamba``, Nemotron-H) each layer
of the pattern costs its own kind: a Mamba-2 mixer its input projection (z, x, B, C, dt), its
causal convolution over x, B and C, the SSD scan at chunk size 64 (per head ``2 P N`` for the
state's write and read, ``C (N + P) / 2`` for the intra-chunk scores and their weighted sum)
and its output projection; an attention layer its projections (no gate) and pairs; an MLP its
up and down projections (not gated); an MoE layer its router, top-k experts and shared expert
(up and down each). The backward pass costs twice the forward. Norms,
rotary embedding, softmax and the K/V gather are not counted: they are memory-bound and small
beside the products. ``tests/test_flops.py`` checks this against the matrix products torch's
``FlopCounterMode`` counts on the Megatron engine's real steps: equal, once the masked half of
each segment that a dense kernel computes (and flash-attn skips) is taken out, and on the
shared step the fused CPU kernel's extra work (its backward recomputes the scores; under MLA
it multiplies V's zero padding).
"""

from __future__ import annotations

from typing import NamedTuple

from .plan import SharingPlan
from .presets import ModelPreset

__all__ = ["FlopCount", "attended_pairs", "count_flops", "flops_per_token_and_pair"]

_FORWARD_AND_BACKWARD = 3


class FlopCount(NamedTuple):
    plain: float
    shared: float

    @property
    def ratio(self) -> float:
        """plain / shared: the largest speedup sharing can give."""
        return self.plain / self.shared


def count_flops(plan: SharingPlan, model: ModelPreset) -> FlopCount:
    """Forward+backward FLOPs of the plain forward of ``plan``'s sequences and of the plan."""
    per_token = _linear_flops_per_token(model)
    per_pair = _attention_flops_per_pair(model)
    windows = [model.layer_window(layer) for layer in _attention_layers(model)]
    plain_pairs = sum(_pairs(n, n, w) for n in plan.seq_lens for w in windows)
    shared_pairs = sum(attended_pairs(plan, w) for w in windows)
    plain = per_token * plan.num_tokens_total + per_pair * plain_pairs
    shared = per_token * plan.num_tokens_unique + per_pair * shared_pairs
    return FlopCount(_FORWARD_AND_BACKWARD * plain, _FORWARD_AND_BACKWARD * shared)


def flops_per_token_and_pair(model: ModelPreset) -> tuple[int, int]:
    """Forward FLOPs of ``model`` per computed token (its linear layers) and per attended
    (query, key) pair summed over its attention layers, windows not applied (a windowed
    layer attends fewer pairs: see :func:`count_flops`)."""
    return (_linear_flops_per_token(model),
            _attention_flops_per_pair(model) * len(_attention_layers(model)))


def _attention_layers(model: ModelPreset) -> list[int]:
    """The 1-based layers that attend (a hybrid's others are recurrent, MLP or MoE layers)."""
    layers = range(1, model.num_layers + 1)
    if model.mamba is not None:
        return [layer for layer in layers if model.mamba.pattern[layer - 1] == "*"]
    return [layer for layer in layers if not model.layer_is_recurrent(layer)]


def _attention_flops_per_pair(model: ModelPreset) -> int:
    """Scores (query . key) and the weighted sum (weight x value) of every head: under MLA
    the query/key and value head dims differ (192 / 128 on DeepSeek-V3)."""
    if model.mla is None:
        return 4 * model.num_attention_heads * model.head_dim
    return 2 * model.num_attention_heads * (model.mla.q_head_dim + model.mla.v_head_dim)


def _linear_flops_per_token(model: ModelPreset) -> int:
    h = model.hidden_size
    if model.mamba is not None:
        return 2 * (sum(map(_mamba_hybrid_layer_macs(model).__getitem__, model.mamba.pattern))
                    + h * model.vocab_size)
    layers = range(1, model.num_layers + 1)
    recurrent = sum(map(model.layer_is_recurrent, layers))
    mlps = sum(_mlp_macs(model, layer) for layer in layers)
    return 2 * ((model.num_layers - recurrent) * _attention_macs(model)
                + recurrent * _recurrent_macs_per_token(model) + mlps + h * model.vocab_size)


def _attention_macs(model: ModelPreset) -> int:
    """Multiply-adds per token of one layer's attention projections. MLA: the query through
    its LoRA (down, up) or one projection, the compressed kv plus the rotary key, their
    up-projection to per-head keys and values, and the output projection."""
    h, n = model.hidden_size, model.num_attention_heads
    mla = model.mla
    if mla is None:
        d = model.head_dim
        gate = 1 if model.full_attention_every is None else 2  # the hybrids' output gate
        return h * (gate * n + 2 * model.num_query_groups) * d + n * d * h
    q_out = n * mla.q_head_dim
    q = h * q_out if mla.q_lora_rank is None else (h + q_out) * mla.q_lora_rank
    kv = (h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
          + mla.kv_lora_rank * n * (mla.qk_head_dim + mla.v_head_dim))
    return q + kv + n * mla.v_head_dim * h


def _mlp_macs(model: ModelPreset, layer: int) -> int:
    """Multiply-adds per token of 1-based ``layer``'s MLP (SwiGLU: gate, up, down). An MoE
    layer (dropless) computes its router, ``topk`` routed experts and any shared expert."""
    h = model.hidden_size
    if not model.num_experts or layer <= model.first_dense_layers:
        return 3 * h * model.ffn_hidden_size
    routed = model.moe_router_topk * 3 * h * (model.moe_ffn_hidden_size or model.ffn_hidden_size)
    shared = 3 * h * (model.moe_shared_expert_size or 0)
    return h * model.num_experts + routed + shared


_GDN_CHUNK = 64


def _recurrent_macs_per_token(model: ModelPreset) -> int:
    """Multiply-adds of one Gated DeltaNet layer per computed token (see the module doc)."""
    h, k, v = model.hidden_size, model.linear_head_dim, model.linear_head_dim
    key_dim, value_dim = model.linear_num_key_heads * k, model.linear_num_value_heads * v
    heads = model.linear_num_value_heads
    projections = h * (2 * key_dim + 2 * value_dim + 2 * heads) + value_dim * h
    conv = model.linear_conv_kernel_dim * (2 * key_dim + value_dim)
    rule = heads * (3 * k * v + _GDN_CHUNK * (5 * k + 3 * v) // 2)
    return projections + conv + rule


_SSD_CHUNK = 64


def _mamba_hybrid_layer_macs(model: ModelPreset) -> dict[str, int]:
    """Multiply-adds per computed token of each Nemotron-H layer kind (see the module doc)."""
    h, m = model.hidden_size, model.mamba
    inner, groups = m.inner_size, m.n_groups * m.state_size
    mixer = (h * (2 * inner + 2 * groups + m.num_heads) + m.conv_kernel * (inner + 2 * groups)
             + m.num_heads * (2 * m.head_dim * m.state_size
                              + _SSD_CHUNK * (m.state_size + m.head_dim) // 2)
             + inner * h)
    n, d = model.num_attention_heads, model.head_dim
    routed = model.moe_ffn_hidden_size or max(1, model.ffn_hidden_size // 2)
    experts = ((model.num_experts or 4) * h + model.moe_router_topk * 2 * h * routed
               + 2 * h * (model.moe_shared_expert_size or routed))
    return {"M": mixer, "*": h * (n + 2 * model.num_query_groups) * d + n * d * h,
            "-": 2 * h * model.ffn_hidden_size, "E": experts}


def _pairs(s: int, L: int, window: int | None) -> int:
    """Allowed (query, key) pairs of a tail of ``s`` queries over ``L`` keys, bottom-right.

    Query ``i`` sits at position ``p = L - s + i`` and sees ``p + 1`` keys (``s * (L - s) +
    s * (s + 1) / 2`` in all), or ``min(p + 1, window)`` on a windowed layer.
    """
    first = L - s + 1  # keys the first query sees without a window
    if window is None or window >= L:
        return s * (L - s) + s * (s + 1) // 2
    growing = max(0, min(L, window) - first + 1)  # queries seeing p + 1 <= window keys
    grow_sum = growing * (first + first + growing - 1) // 2
    return grow_sum + (s - growing) * window


def attended_pairs(plan: SharingPlan, window: int | None = None) -> int:
    """Allowed (query, key) pairs of the plan's segments on one layer, padding excluded: each
    computed query attends its sequence's keys up to itself, bottom-right causal."""
    q = plan.cu_seqlens_q.tolist()
    kv = plan.cu_seqlens_kv.tolist()
    segments = len(q) - 1 - (1 if plan.num_padding else 0)
    return sum(_pairs(q[i + 1] - q[i], kv[i + 1] - kv[i], window) for i in range(segments))
