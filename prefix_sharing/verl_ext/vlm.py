"""Vision-language checkpoints in verl's FSDP engine: its images planned with their prefixes.

verl hands a VLM micro-batch to its engine as jagged ``input_ids``, 4-row ``position_ids``
(text positions over the three mrope rows) and a per-sample ``multi_modal_inputs`` field (one
dict of ``pixel_values`` / ``image_grid_thw`` or ``None`` per sample, as verl's dataset and
agent loop store them). The sharing engine plans the micro-batch with the images' identity
(:func:`prefix_sharing.fsdp_compat.vision.vision_batch`), runs the encoder once per distinct
image and takes each computed token's mrope rows from the model's ``get_rope_index`` on its
whole sequence (:mod:`prefix_sharing.fsdp_compat.mrope`): the rows verl's dataset computed the
same way. verl's ``position_ids`` are not read.

verl's ``apply_monkey_patch`` replaces, class-wide, the forwards of these families with its own
(the image merge calls the vision tower directly instead of ``get_image_features``; Qwen2.5-VL's
attention calls flash-attention's varlen kernel directly instead of the attention function
transformers dispatches to). The sharing model needs transformers' own forwards: they are
recorded when verl's engine module is imported (:func:`record_stock_forwards`, before any
engine is built) and put back on the sharing model's instances only
(:func:`restore_stock_forwards`), so a stock engine in the same process keeps verl's.
:data:`ENGINE_FAMILIES` are the families tested on the engine; the other VLM families stay
refused (``verl.multimodal``; :data:`UNSERVED_FAMILIES` names the reason for those verl's recipes
train).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InputError, PrefixSharingSetupError
from ..refusals import refuse

__all__ = ["ENGINE_FAMILIES", "UNSERVED_FAMILIES", "record_stock_forwards",
           "restore_stock_forwards", "micro_batch_images", "blank_image_kwargs"]

# family -> (transformers module, the classes whose forward verl's apply_monkey_patch replaces)
_PATCHED = {
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                   ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel",
                    "Qwen2_5_VLAttention")),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl",
                 ("Qwen3VLForConditionalGeneration", "Qwen3VLModel")),
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
                     ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel")),
    # Qwen3.5: verl also patches the Gated DeltaNet class-wide; the sharing engine switches
    # each GDN layer to a subclass of its own (fsdp_compat), whose forward wins over both
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5",
                ("Qwen3_5ForConditionalGeneration", "Qwen3_5Model", "Qwen3_5DecoderLayer")),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                    ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel",
                     "Qwen3_5MoeDecoderLayer")),
}
ENGINE_FAMILIES: tuple[str, ...] = tuple(_PATCHED)
# the vision-language families verl's FSDP recipes train that the engine refuses, and why
UNSERVED_FAMILIES = {
    "glm4v": "GLM-4.1V's vision tower and its own 3-row positions (get_rope_index over image "
             "and video groups) are not among the HF shim's vision-language families",
    "minicpmo": "transformers ships no MiniCPM-o model (the checkpoint's remote code places its "
                "vision and audio features), so there is no stock forward to be exact against",
}
BLANK_GRID = (1, 4, 4)  # the blank image verl's forwards encode for a text-only micro-batch
_STOCK: dict[type, Any] = {}  # class -> transformers' own forward


def record_stock_forwards() -> None:
    """Records transformers' forwards of the classes verl patches (once; call before verl's
    ``apply_monkey_patch`` runs: at the import of its engine module). A class whose forward is
    not transformers' own any more is not recorded (:func:`restore_stock_forwards` refuses)."""
    for module_name, classes in _PATCHED.values():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a transformers without the family (verl 0.8.0's 4.57)
            continue
        for name in classes:
            cls = getattr(module, name, None)
            forward = None if cls is None else cls.__dict__.get("forward")
            if cls not in _STOCK and getattr(forward, "__module__", "") == module_name:
                _STOCK[cls] = forward


def restore_stock_forwards(hf_module: torch.nn.Module) -> None:
    """Gives every module of ``hf_module`` whose class verl patched transformers' own forward
    (an instance attribute: the class keeps verl's for stock engines)."""
    module_name, classes = _PATCHED[hf_module.config.model_type]
    module = importlib.import_module(module_name)
    patched = {getattr(module, name) for name in classes}
    missing = sorted(cls.__name__ for cls in patched if cls not in _STOCK)
    if missing:
        raise refuse("verl.multimodal", f"verl patched {', '.join(missing)}.forward before "
                     "prefix sharing could record transformers' own", error=PrefixSharingSetupError)
    for sub in hf_module.modules():
        stock = next((_STOCK[cls] for cls in type(sub).__mro__ if cls in patched), None)
        if stock is not None:
            sub.forward = types.MethodType(stock, sub)


def micro_batch_images(micro_batch: Any, num_sequences: int) -> list[Mapping | None] | None:
    """The micro-batch's ``multi_modal_inputs``, one dict or ``None`` per sample in its order
    (verl stores each as ``NonTensorData``); ``None`` when the field is absent."""
    entries = micro_batch.get("multi_modal_inputs", None)
    if entries is None:
        return None
    per_sample = [getattr(entry, "data", entry) for entry in entries]
    if len(per_sample) != num_sequences:
        raise InputError(f"{len(per_sample)} multi_modal_inputs for a micro-batch of "
                         f"{num_sequences} samples")
    return per_sample


def blank_image_kwargs(hf_module: torch.nn.Module, device: torch.device) -> dict:
    """The forward keywords of a text-only micro-batch of a VLM: one blank image, none of whose
    features is placed (no placeholder row reads it). verl's own forwards of these families
    encode such an image on a text-only micro-batch and add 0 x its features: every rank runs
    the tower's FSDP collectives (a rank with images and one without would otherwise wait on
    each other) and the tower's parameters get zero gradients, as in verl's stock step."""
    from ..fsdp_compat.vlm import IMAGE_ROWS_KWARG, inner_model

    vision = hf_module.config.vision_config
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    patches = BLANK_GRID[0] * BLANK_GRID[1] * BLANK_GRID[2]
    return {"pixel_values": torch.zeros(patches, patch, device=device,
                                        dtype=inner_model(hf_module).visual.dtype),
            "image_grid_thw": torch.tensor([BLANK_GRID], device=device),
            IMAGE_ROWS_KWARG: torch.zeros(0, dtype=torch.long, device=device)}
