"""Model shapes used by ``prefix-sharing analyze / verify / bench``: random weights, no download."""

from __future__ import annotations

import dataclasses

__all__ = ["ModelPreset", "PRESETS", "get_preset"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """A decoder-only transformer's shape (Llama / Qwen style: RoPE, RMSNorm, SwiGLU, GQA)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    max_sequence_length: int
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    rotary_base: float = 10000.0
    # Mixture of experts (dropless, top-k): every MLP becomes num_experts experts of
    # moe_ffn_hidden_size each; None keeps the dense MLP.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # seconds on a laptop CPU: for tests and the demo
        ModelPreset("tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=128, vocab_size=512,
                    max_sequence_length=4096),
        # the tiny shape with 8 experts, top-2 (verify checks the router's losses on it too)
        ModelPreset("tiny-moe", num_layers=2, hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=128, vocab_size=512,
                    max_sequence_length=4096, num_experts=8, moe_ffn_hidden_size=64),
        # big enough that matrix products dominate, as on a real model; minutes on CPU
        ModelPreset("small", num_layers=4, hidden_size=512, num_attention_heads=8,
                    num_query_groups=2, ffn_hidden_size=1408, vocab_size=8192,
                    max_sequence_length=8192),
        # Qwen2.5-0.5B's architecture (config.json of Qwen/Qwen2.5-0.5B), random weights
        ModelPreset("qwen2.5-0.5b", num_layers=24, hidden_size=896, num_attention_heads=14,
                    num_query_groups=2, ffn_hidden_size=4864, vocab_size=151936,
                    max_sequence_length=32768, add_qkv_bias=True, tie_embeddings=True,
                    rotary_base=1_000_000.0),
    )
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
