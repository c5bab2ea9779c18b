"""Model shapes used by ``prefix-sharing analyze / verify / bench``: random weights, no download."""

from __future__ import annotations

import dataclasses

from .errors import InputError

__all__ = ["MLAShape", "MambaShape", "ModelPreset", "PRESETS", "get_preset", "sharp",
           "VOCAB_MULTIPLE", "VISION_SPECIAL_IDS", "SHARP_INIT_STD"]

VOCAB_MULTIPLE = 128  # Megatron-LM's default make_vocab_size_divisible_by
MAX_RANDOM_VOCAB = 1 << 20  # real tokenizers stay below 300k
VISION_SPECIAL_IDS = 4  # a VLM preset's image, video, vision start and end ids (fsdp_compat.vlm)


@dataclasses.dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention's projection sizes (DeepSeek-V3: q_lora_rank 1536, kv_lora_rank
    512, qk_head_dim 128, qk_pos_emb_head_dim 64, v_head_dim 128). Queries and keys have
    ``qk_head_dim + qk_pos_emb_head_dim`` channels per head, values ``v_head_dim``; every head
    reads one rotary key of ``qk_pos_emb_head_dim`` channels."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim


@dataclasses.dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 hybrid's layout (Nemotron-H): ``pattern`` has one letter per layer, ``M`` a
    Mamba-2 mixer, ``*`` attention, ``-`` an MLP, ``E`` an MoE layer (transformers'
    ``hybrid_override_pattern``); each mixer has ``num_heads`` SSD heads of ``head_dim``
    channels, a state of ``state_size`` per channel with B/C in ``n_groups`` groups, and a
    causal convolution ``conv_kernel`` wide over x, B and C."""

    pattern: str
    num_heads: int = 4
    head_dim: int = 16
    state_size: int = 16
    n_groups: int = 2
    conv_kernel: int = 4

    @property
    def num_mixers(self) -> int:
        return self.pattern.count("M")

    @property
    def inner_size(self) -> int:
        """The mixer's x width (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim


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
    # A real model's vocabulary (its tokenizer's): token ids beyond it are the user's error.
    # Otherwise the vocabulary is a free choice of the random model, sized to the data.
    real_vocabulary: bool = False
    # Mixture of experts (dropless, top-k): every MLP becomes num_experts experts of
    # moe_ffn_hidden_size each; None keeps the dense MLP.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    # DeepSeek-V3's MoE: a shared expert of this size beside the routed ones, sigmoid scores
    # with a per-expert bias on the choice (not the weights), and the first layers dense
    moe_shared_expert_size: int | None = None
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    first_dense_layers: int = 0
    # multi-latent attention (None: grouped-query attention of head_dim channels)
    mla: MLAShape | None = None
    # Sliding-window attention (gpt-oss, Gemma 3 style): each query of a windowed layer sees
    # its last window_size keys, itself included; every window_full_every-th layer (1-based,
    # megatron's window_attn_skip_freq) is full. None: every layer full.
    window_size: int | None = None
    window_full_every: int | None = None
    # megatron's softmax_type: "learnable" adds a learned sink logit per head to every query's
    # softmax denominator (gpt-oss's sinks), "off-by-one" a fixed zero one
    softmax_type: str = "vanilla"
    # Gated DeltaNet hybrids (Qwen3.5 / Qwen3-Next): every full_attention_every-th layer
    # (1-based) is gated full attention, the others Gated DeltaNet layers with these heads
    # (key heads, value heads, one head dim for both) and a causal convolution this wide.
    # None: every layer is attention.
    full_attention_every: int | None = None
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    # Mamba-2 hybrid (Nemotron-H, --engine hf only): the layer pattern and the mixers' shape
    # (num_layers is the pattern's length; E layers use num_experts / moe_ffn_hidden_size /
    # moe_shared_expert_size, - layers ffn_hidden_size). None: not a Mamba hybrid.
    mamba: MambaShape | None = None
    # the transformers family ``--engine hf`` builds (None: chosen from the shape, see
    # prefix_sharing.engines.hf.family_of); the Megatron engine builds its GPT of this shape
    hf_family: str | None = None
    # A vision-language preset (--engine hf only; hf_family a VLM family): its vocabulary's last
    # VISION_SPECIAL_IDS ids are the image / video / vision start / end tokens, and bench puts one
    # synthetic image of this (t, h, w) patch grid into every sequence's prompt. None: text only.
    image_grid: tuple[int, int, int] | None = None
    # Standard deviation of the random weights (norm weights excepted). Small weights make
    # attention and routing nearly uniform, where a wrong key row or a dropped token multiplicity
    # barely moves the outputs: exactness tests use :func:`sharp` presets instead.
    init_std: float = 0.05

    @property
    def text_vocab_size(self) -> int:
        """The ids a workload's text may use: the vocabulary less a VLM's vision specials."""
        return self.vocab_size - VISION_SPECIAL_IDS * (self.image_grid is not None)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_window(self, layer: int) -> int | None:
        """The window of 1-based ``layer`` (megatron's ``is_layer_window_attention``), or None."""
        if self.window_size is None:
            return None
        if self.window_full_every is None:
            return self.window_size
        return None if layer % self.window_full_every == 0 else self.window_size

    def layer_is_recurrent(self, layer: int) -> bool:
        """Whether 1-based ``layer`` is a Gated DeltaNet layer (see ``full_attention_every``)."""
        return self.full_attention_every is not None and layer % self.full_attention_every != 0

    @property
    def hybrid_pattern(self) -> str | None:
        """The Megatron ``HybridModel`` layer pattern of a Gated DeltaNet hybrid (``None`` for
        a GPT): per layer its mixer, ``G`` (Gated DeltaNet) or ``*`` (attention), then its MLP,
        ``-`` (dense) or ``E`` (experts) - ``"G-G-G-*-"`` for tiny-hybrid."""
        if self.full_attention_every is None:
            return None
        mlp = "E" if self.num_experts else "-"
        return "".join(("G" if self.layer_is_recurrent(layer) else "*") + mlp
                       for layer in range(1, self.num_layers + 1))

    def first_stage_layers(self, pipeline_parallel: int) -> int | None:
        """Layers of the first of ``pipeline_parallel`` stages when they do not split the
        layers evenly (megatron's ``num_layers_in_first_pipeline_stage``), None when they do.

        Every later stage holds ``ceil(num_layers / pipeline_parallel)`` layers and the first
        the rest, as DeepSeek-V3's recipes give the embedding's stage fewer layers: ``tiny-mla``
        (3 layers) at PP=2 puts its dense layer on the first stage, its two MoE layers on the
        second. A hybrid's layer pattern is split evenly only.

        Raises:
            InputError: no such split (the first stage would be empty), or a hybrid's layers
                that ``pipeline_parallel`` does not divide.
        """
        if self.num_layers % pipeline_parallel == 0:
            return None
        later = -(-self.num_layers // pipeline_parallel)
        first = self.num_layers - (pipeline_parallel - 1) * later
        if first < 1 or self.hybrid_pattern is not None:
            raise InputError(f"--pp {pipeline_parallel} does not divide the {self.name} "
                             f"preset's {self.num_layers} layers")
        return first

    def fitted_to(self, max_token_id: int, tensor_parallel: int = 1) -> ModelPreset:
        """This shape with a vocabulary that holds ``max_token_id``.

        With random weights the vocabulary is only the embedding's and LM head's size, so a
        preset without a real vocabulary grows to ``max_token_id + 1``, rounded up to a multiple
        of ``128 * tensor_parallel`` (as Megatron-LM's ``make_vocab_size_divisible_by`` pads
        it, so that every tensor-parallel rank holds an equal slice). A preset with a real
        vocabulary is returned unchanged: ids beyond it do not belong to that model.
        """
        if self.real_vocabulary or max_token_id < self.vocab_size:
            return self
        if max_token_id >= MAX_RANDOM_VOCAB:
            raise InputError(f"token id {max_token_id} would need a vocabulary of more than "
                             f"{MAX_RANDOM_VOCAB} entries; no tokenizer has one")
        multiple = VOCAB_MULTIPLE * tensor_parallel
        return dataclasses.replace(self, vocab_size=-(-(max_token_id + 1) // multiple) * multiple)


# seconds on a laptop CPU: for tests and the demo; the other tiny presets are variants of it
_TINY = ModelPreset("tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=128, vocab_size=512,
                    max_sequence_length=4096)

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _TINY,
        # 8 experts, top-2 (verify checks the router's losses on it too)
        dataclasses.replace(_TINY, name="tiny-moe", num_experts=8, moe_ffn_hidden_size=64),
        # gpt-oss's attention: 4 layers alternating a 16-token sliding window and full
        # attention, learned sinks (verify checks windows, trimmed gathers and the sinks'
        # gradients on it)
        dataclasses.replace(_TINY, name="tiny-window", num_layers=4, window_size=16,
                            window_full_every=2, softmax_type="learnable"),
        # Gemma 3 / Gemma 4 text models (--engine hf): an 8-token window on every other layer
        # (the megatron engine builds a windowed GPT of the same shape)
        dataclasses.replace(_TINY, name="tiny-gemma3", window_size=8, window_full_every=2,
                            hf_family="gemma3_text"),
        dataclasses.replace(_TINY, name="tiny-gemma4", window_size=8, window_full_every=2,
                            hf_family="gemma4_text"),
        # Qwen3.5's layout (--engine hf: transformers' qwen3_5_text): three Gated DeltaNet
        # layers, then one gated full-attention layer (output gate, partial rotary, QK-norm)
        dataclasses.replace(_TINY, name="tiny-hybrid", num_layers=4, full_attention_every=4,
                            hf_family="qwen3_5_text"),
        # Qwen2.5-VL (--engine hf only): tiny's language model as Qwen2 with a 2-block vision
        # tower (width 32, 2x2 patches merged 2x2); bench puts an image of 16 x 16 patches (64
        # vision tokens) into every prompt
        dataclasses.replace(_TINY, name="tiny-qwen2.5-vl", add_qkv_bias=True,
                            hf_family="qwen2_5_vl", image_grid=(1, 16, 16)),
        # Nemotron-H's layout (--engine hf: transformers' nemotron_h): Mamba-2 mixers (4 heads of
        # 16, state 16, 2 groups), an MLP, one attention layer and an MoE layer (4 experts,
        # top-2, a shared expert)
        dataclasses.replace(_TINY, name="tiny-nemotron-h", num_layers=5, num_experts=4,
                            moe_ffn_hidden_size=32, moe_shared_expert_size=32,
                            mamba=MambaShape(pattern="M-M*E"), hf_family="nemotron_h"),
        # DeepSeek-V3's shape, tiny: MLA with q LoRA (q/k 24 channels per head, 16 of them
        # rotary-free, v 16), MoE of 8 experts top-2 with a shared expert, sigmoid routing with
        # expert bias, the first layer dense
        dataclasses.replace(_TINY, name="tiny-mla", num_layers=3, num_query_groups=4,
                            num_experts=8, moe_ffn_hidden_size=32, moe_shared_expert_size=32,
                            moe_score_function="sigmoid", moe_expert_bias=True,
                            first_dense_layers=1,
                            mla=MLAShape(q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16,
                                         qk_pos_emb_head_dim=8, v_head_dim=16)),
        # big enough that matrix products dominate, as on a real model; minutes on CPU
        ModelPreset("small", num_layers=4, hidden_size=512, num_attention_heads=8,
                    num_query_groups=2, ffn_hidden_size=1408, vocab_size=8192,
                    max_sequence_length=8192),
        # "small" as DeepSeek-V3 (bench's MLA rows): MLA with q LoRA (V3's head dims halved:
        # q/k 64 + 32 rotary channels a head, v 64; latents 256 / 128), a dense first layer
        # (small's MLP), then MoE layers of 16 experts top-4 of width 256 plus a shared one -
        # 5 x 256 active channels per token, about small's 1408 - sigmoid routing, expert bias
        ModelPreset("small-mla", num_layers=4, hidden_size=512, num_attention_heads=8,
                    num_query_groups=8, ffn_hidden_size=1408, vocab_size=8192,
                    max_sequence_length=8192, num_experts=16, moe_router_topk=4,
                    moe_ffn_hidden_size=256, moe_shared_expert_size=256,
                    moe_score_function="sigmoid", moe_expert_bias=True, first_dense_layers=1,
                    mla=MLAShape(q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64,
                                 qk_pos_emb_head_dim=32, v_head_dim=64)),
        # "small" as a Qwen3.5-style hybrid (--engine hf): 3 Gated DeltaNet layers (4 key heads,
        # 8 value heads of 64: q/k half, v the full hidden width, as Qwen3.5's) to 1 attention
        ModelPreset("small-hybrid", num_layers=4, hidden_size=512, num_attention_heads=8,
                    num_query_groups=2, ffn_hidden_size=1408, vocab_size=8192,
                    max_sequence_length=8192, full_attention_every=4, linear_num_key_heads=4,
                    linear_num_value_heads=8, linear_head_dim=64, hf_family="qwen3_5_text"),
        # Qwen2.5-0.5B's architecture (config.json of Qwen/Qwen2.5-0.5B), random weights
        ModelPreset("qwen2.5-0.5b", num_layers=24, hidden_size=896, num_attention_heads=14,
                    num_query_groups=2, ffn_hidden_size=4864, vocab_size=151936,
                    max_sequence_length=32768, add_qkv_bias=True, tie_embeddings=True,
                    rotary_base=1_000_000.0, real_vocabulary=True),
    )
}


# With this std the tiny preset's attention is far from uniform: on 64 random tokens the last
# layer's attention entropy is about a third of the uniform distribution's and each query's
# largest weight about 0.6 (0.05: 0.997 of uniform, largest weight 0.05); routers likewise.
SHARP_INIT_STD = 0.25


def sharp(preset: ModelPreset, init_std: float = SHARP_INIT_STD) -> ModelPreset:
    """``preset`` with weights large enough that attention and routing are far from uniform,
    so that a check comparing two runs on it has the power to see a wrong prefix row."""
    return dataclasses.replace(preset, name=f"{preset.name}-sharp", init_std=init_std)


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise InputError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
