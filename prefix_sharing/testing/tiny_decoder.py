"""A small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) in plain torch.

It is the model of the core equivalence checks: readable enough to be its own reference, and
with the pieces whose interaction with sharing matters - rotary positions that must be absolute,
grouped K/V heads, and attention as the only place where tokens meet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyDecoderConfig", "TinyDecoder", "AttendFn", "causal_attend"]

# attend(q, k, v) -> out, with q (T, heads, head_dim) and k, v (T, kv_heads, head_dim).
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TinyDecoderConfig:
    vocab_size: int = 101  # prime, so it lines up with no power-of-two size by accident
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA: two query heads per K/V head
    num_layers: int = 2
    ffn_size: int = 96
    rope_base: float = 10000.0
    norm_eps: float = 1e-6


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of one whole sequence: the reference the plan must reproduce."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        enable_gqa=q.size(1) != k.size(1),
    )
    return out.transpose(0, 1)


class TinyDecoder(nn.Module):
    def __init__(self, config: TinyDecoderConfig = TinyDecoderConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        head_dim = config.hidden_size // config.num_heads
        inv_freq = config.rope_base ** -(torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """``(T,)`` tokens at ``(T,)`` absolute positions -> ``(T, vocab)`` logits."""
        angles = position_ids.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim / 2]
        cos, sin = angles.cos(), angles.sin()
        h = self.embed(input_ids)  # [T, hidden]
        for layer in self.layers:
            h = layer(h, cos, sin, attend)
        return self.lm_head(self.norm(h))

    def forward_plain(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        """The plain forward: each sequence on its own, positions from 0; packed ``(T_total, vocab)``."""
        return torch.cat(
            [self(s, torch.arange(s.numel(), device=s.device), causal_attend) for s in sequences]
        )


class _Block(nn.Module):
    def __init__(self, config: TinyDecoderConfig) -> None:
        super().__init__()
        c = config
        self.head_dim = c.hidden_size // c.num_heads
        self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads
        self.attn_norm = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.qkv = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * self.head_dim)
        self.proj = nn.Linear(c.num_heads * self.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.ffn_size, bias=False)
        self.down = nn.Linear(c.ffn_size, c.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        T = h.size(0)
        q, k, v = self.qkv(self.attn_norm(h)).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], dim=-1,
        )
        q = _rotate(q.view(T, self.num_heads, self.head_dim), cos, sin)  # [T, heads, hd]
        k = _rotate(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)  # [T, kv_heads, hd]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        h = h + self.proj(attend(q, k, v).reshape(T, -1))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split convention) of ``(T, heads, hd)`` at per-token angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
