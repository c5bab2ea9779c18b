"""Prefix sharing for HuggingFace transformers models, plain or under FSDP2.

Usage::

    from prefix_sharing.fsdp_compat import enable_prefix_sharing, shared_forward

    enable_prefix_sharing(model)            # before fully_shard / gradient checkpointing
    out = shared_forward(model, sequences, PrefixSharingConfig())
    loss = pg_loss(out.stats.log_probs, out.stats.entropy, advantages)

Modules: :mod:`.attention` (the attention function transformers calls), :mod:`.forward` (the
model call and the log-probs), :mod:`.response_rows` (the LM head on response rows only),
:mod:`.head` (log-probs and entropy from the hidden states in chunks of rows, no logits),
:mod:`.cross_steps` (a group run across micro-batches, its steps in a plain loop),
:mod:`.moe` (the exact router loss), :mod:`.gated_deltanet` (Qwen3.5 / Qwen3-Next's recurrent
layers on the plan), :mod:`.mamba2` (Nemotron-H's Mamba-2 mixers on the plan), :mod:`.vlm`, :mod:`.vision` and
:mod:`.mrope` (vision-language checkpoints: the switch, the images, the mrope positions),
:mod:`.models`
(families, seeded models, what is refused), :mod:`.fsdp` (FSDP2 wrapping), :mod:`.runs` (plain
and shared runs for the equivalence checks;
:mod:`.plain_kernels`, the recurrence of their plain runs), :mod:`.prefix_grouper_peer` (the
PrefixGrouper reference). transformers is imported only when a function needs it.
"""

from .attention import ATTENTION_NAME, prefix_sharing_attention, register_attention
from .forward import SharedForward, enable_prefix_sharing, model_kwargs, shared_forward
from .models import (
    ATTENTION_FAMILIES,
    FAMILIES,
    HYBRID_FAMILIES,
    MAMBA_HYBRID_FAMILIES,
    VLM_FAMILIES,
    build_model,
    check_supported,
    hf_config,
)
from .moe import router_aux_loss, row_multiplicity
from .response_rows import ResponseRows, response_rows

__all__ = [
    "ATTENTION_FAMILIES",
    "ATTENTION_NAME",
    "FAMILIES",
    "HYBRID_FAMILIES",
    "MAMBA_HYBRID_FAMILIES",
    "ResponseRows",
    "SharedForward",
    "VLM_FAMILIES",
    "build_model",
    "check_supported",
    "enable_prefix_sharing",
    "hf_config",
    "model_kwargs",
    "prefix_sharing_attention",
    "register_attention",
    "response_rows",
    "router_aux_loss",
    "row_multiplicity",
    "shared_forward",
]
