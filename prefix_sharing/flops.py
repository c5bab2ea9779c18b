"""Forward+backward FLOPs of a micro-batch, plain and shared: the physical limit of the saving.

Counted: every linear layer (QKV, output projection, MLP, LM head) at 2 FLOPs per multiply-add
per computed token, and attention at 4 * heads * head_dim FLOPs per (query, key) pair the causal
mask allows (scores and the weighted sum; on a sliding-window layer, the pairs inside the
window). On a Gated DeltaNet hybrid (``full_attention_every``), each recurrent layer costs per
computed token its projections (q, k, v, output gate z, beta, decay; output), its causal
convolution, and the chunked gated delta rule's products at chunk size 64 (per value head
``6 K V`` for the state's reads and writes, ``C (5 K + 3 V)`` for the intra-chunk products and
triangular solves): linear in the tokens, like an MLP, so sharing saves it in the token ratio;
the attention layers of a hybrid gate their output (a q projection twice as wide). The backward
pass costs twice the forward. Norms,
rotary embedding, softmax and the K/V gather are not counted: they are memory-bound and small
beside the products. ``tests/test_flops.py`` checks this against the matrix products torch's
``FlopCounterMode`` counts on the Megatron engine's real steps: equal, once the masked half of
each segment that a dense kernel computes (and flash-attn skips) is taken out.
"""

from __future__ import annotations

from typing import NamedTuple

from .plan import SharingPlan
from .presets import ModelPreset

__all__ = ["FlopCount", "count_flops"]

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
    per_pair = 4 * model.num_attention_heads * model.head_dim
    windows = [model.layer_window(layer) for layer in range(1, model.num_layers + 1)
               if not model.layer_is_recurrent(layer)]
    plain_pairs = sum(_pairs(n, n, w) for n in plan.seq_lens for w in windows)
    shared_pairs = sum(_plan_pairs(plan, w) for w in windows)
    plain = per_token * plan.num_tokens_total + per_pair * plain_pairs
    shared = per_token * plan.num_tokens_unique + per_pair * shared_pairs
    return FlopCount(_FORWARD_AND_BACKWARD * plain, _FORWARD_AND_BACKWARD * shared)


def _linear_flops_per_token(model: ModelPreset) -> int:
    h, d = model.hidden_size, model.head_dim
    recurrent = sum(map(model.layer_is_recurrent, range(1, model.num_layers + 1)))
    gate = 1 if model.full_attention_every is None else 2  # the hybrids' output gate
    qkv = h * (gate * model.num_attention_heads + 2 * model.num_query_groups) * d
    proj = model.num_attention_heads * d * h
    mlp = 3 * h * model.ffn_hidden_size  # SwiGLU: gate, up, down
    attention = (model.num_layers - recurrent) * (qkv + proj)
    return 2 * (attention + recurrent * _recurrent_macs_per_token(model)
                + model.num_layers * mlp + h * model.vocab_size)


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


def _plan_pairs(plan: SharingPlan, window: int | None) -> int:
    """Allowed (query, key) pairs of the plan's segments on one layer, padding excluded."""
    q = plan.cu_seqlens_q.tolist()
    kv = plan.cu_seqlens_kv.tolist()
    segments = len(q) - 1 - (1 if plan.num_padding else 0)
    return sum(_pairs(q[i + 1] - q[i], kv[i + 1] - kv[i], window) for i in range(segments))
