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

Refused (:func:`ulysses_problems`): models with recurrent layers switched to their sharing
forms (Gated DeltaNet, Mamba-2), whose recurrence over the plan's segments would need its
state passed between ranks (verl itself runs Qwen3.5's GDN under Ulysses only through FLA's
context-parallel kernels, CUDA only, and Qwen3-Next's and Nemotron-H's not at all), and
vision-language models (verl slices their sequence after the embedding, inside the text model).
"""

from __future__ import annotations

from typing import Any

from ..refusals import Refused

__all__ = ["plan_padding", "sequence_parallel_group", "ulysses_problems"]

# The class markers of recurrent modules switched to their sharing forms (fsdp_compat).
RECURRENT_MARKERS = ("_prefix_sharing_gdn", "_prefix_sharing_mamba")


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


def ulysses_problems(hf_module: Any, size: int) -> list[Refused]:
    """Why the switched model cannot run under Ulysses over ``size`` ranks (nothing when it
    can; module doc)."""
    if size <= 1:
        return []
    from ..fsdp_compat.vlm import is_vlm

    setting = f"ulysses_sequence_parallel_size={size}"
    found = []
    if has_recurrent_layers(hf_module):
        found.append(Refused("verl.ulysses.recurrent",
                             f"{setting} with {type(hf_module).__name__}'s recurrent layers"))
    if is_vlm(hf_module):
        found.append(Refused("verl.ulysses.vlm",
                             f"{setting} with the vision-language {type(hf_module).__name__}"))
    return found
