"""verl's Ulysses sequence parallelism (``ulysses_sequence_parallel_size > 1``) in the FSDP
engine with sharing.

verl's own step (``verl/workers/engine/fsdp/transformer_impl.py``): ``prepare_model_inputs``
pads the packed row to a multiple of the group size and gives each rank its slice
(``ulysses_pad_and_slice_inputs``); the model's flash-attention function, patched by
``apply_monkey_patch``, runs an all-to-all around the kernel; ``prepare_model_outputs`` scores
the rank's slice and all-gathers the log-probs and entropy (``gather_outputs_and_unpad``).
With sharing the engine does the same to the plan's flat layout: the plan is padded to a
multiple of the group size (:func:`plan_padding`), each rank runs its rows
(:func:`prefix_sharing.fsdp_compat.ulysses.ulysses_model_kwargs`), the sharing attention runs
its own all-to-all (:mod:`prefix_sharing.fsdp_compat.ulysses`), and every rank gets every
sample's log-probs and entropy in verl's output contract
(:func:`~prefix_sharing.fsdp_compat.ulysses.ulysses_token_stats`).

Refused at the engine's construction (:func:`ulysses_problems`, from the HF config, so
``prefix-sharing preflight`` says it too): models with recurrent layers switched to their sharing
forms (Gated DeltaNet, Mamba-2), whose recurrence over the plan's segments would need its
state passed between ranks (verl itself runs Qwen3.5's GDN under Ulysses only through FLA's
context-parallel kernels, CUDA only, and Qwen3-Next's and Nemotron-H's not at all), and
vision-language models (verl slices their sequence after the embedding, inside the text model).
"""

from __future__ import annotations

from typing import Any

from ..refusals import Refused

__all__ = ["plan_padding", "recurrent_layer_types", "sequence_parallel_group",
           "ulysses_problems"]

# The class markers of recurrent modules switched to their sharing forms (fsdp_compat).
RECURRENT_MARKERS = ("_prefix_sharing_gdn", "_prefix_sharing_mamba")
# The configs' names of those layers (``layer_types`` / ``layers_block_type`` entries).
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba"})


def sequence_parallel_group(engine: Any) -> Any | None:
    """The engine's Ulysses process group, ``None`` without Ulysses (both releases name it
    ``ulysses_parallel_group``)."""
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        return engine.ulysses_parallel_group
    return None


def plan_padding(engine: Any) -> int:
    """``build_plan``'s ``pad_to_multiple_of`` for the engine: its Ulysses group's size."""
    return getattr(engine, "ulysses_sequence_parallel_size", 1)


def has_recurrent_layers(hf_module: Any) -> bool:
    """Whether ``enable_prefix_sharing`` switched some of the model's layers to a sharing
    recurrence (Gated DeltaNet, Mamba-2)."""
    return any(getattr(m, marker, False) for m in hf_module.modules()
               for marker in RECURRENT_MARKERS)


def ulysses_problems(hf_config: Any, size: int) -> list[Refused]:
    """Why a model of ``hf_config`` cannot run with sharing under Ulysses over ``size`` ranks
    (nothing when it can; module doc), read from the config alone so that the engine's
    construction and ``preflight`` say it before any model is built: recurrent layers are the
    ``layer_types`` (or Nemotron-H's ``layers_block_type``) the sharing engine switches to a
    sharing recurrence (:func:`has_recurrent_layers` on the switched model), a vision-language
    model has a ``vision_config``."""
    if size <= 1:
        return []
    setting = f"ulysses_sequence_parallel_size={size}"
    model_type = getattr(hf_config, "model_type", type(hf_config).__name__)
    found = []
    if recurrent_layer_types(hf_config):
        found.append(Refused("verl.ulysses.recurrent",
                             f"{setting} with {model_type}'s recurrent layers"))
    if getattr(hf_config, "vision_config", None) is not None:
        found.append(Refused("verl.ulysses.vlm",
                             f"{setting} with the vision-language {model_type}"))
    return found


def recurrent_layer_types(hf_config: Any) -> set[str]:
    """The recurrent layer kinds (``linear_attention``: Gated DeltaNet; ``mamba``) among the
    config's (or its text config's) layers."""
    text = getattr(hf_config, "text_config", None) or hf_config
    kinds = set()
    for field in ("layer_types", "layers_block_type"):
        kinds.update(getattr(text, field, None) or ())
    return kinds & RECURRENT_LAYER_TYPES
