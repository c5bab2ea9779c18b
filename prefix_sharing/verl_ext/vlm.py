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
refused (``verl.multimodal``).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import InputError, PrefixSharingSetupError
from ..refusals import refuse

__all__ = ["ENGINE_FAMILIES", "record_stock_forwards", "restore_stock_forwards",
           "micro_batch_images"]

# family -> (transformers module, the classes whose forward verl's apply_monkey_patch replaces)
_PATCHED = {
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                   ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel",
                    "Qwen2_5_VLAttention")),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl",
                 ("Qwen3VLForConditionalGeneration", "Qwen3VLModel")),
}
ENGINE_FAMILIES: tuple[str, ...] = tuple(_PATCHED)
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
