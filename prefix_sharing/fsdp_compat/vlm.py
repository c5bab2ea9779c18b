"""Vision-language checkpoints (Qwen2.5-VL, Qwen3-VL, Qwen3.5) under the sharing forward.

A ``...ForConditionalGeneration`` of these families is a causal LM with a vision tower whose
output replaces the embeddings of the image placeholder tokens. Sharing switches the *text*
model to the sharing attention (and Qwen3.5's Gated DeltaNet layers to the sharing recurrence);
the vision tower keeps its own attention and runs once per distinct image of the micro-batch
(:mod:`.vision`). Their rotary positions are multi-dimensional (mrope: temporal, height, width
rows; text-only the three coincide), carried per computed token (:mod:`.mrope`).

The encoder's output reaches the flat layout through the model's own forward: the inner model's
``get_image_features`` is switched, in place, to one that gathers each computed placeholder
row's feature (and Qwen3-VL's deepstack features) from the distinct images' features through
the ``sharing_image_rows`` keyword, so everything runs inside the root module's forward (FSDP
gathers the vision tower's weights there as for any stock call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import MissingPackageError
from ..refusals import refuse
from ..presets import ModelPreset
from .switch import InPlaceSwitch

__all__ = ["VLM_FAMILIES", "TEXT_FAMILY", "IMAGE_ROWS_KWARG", "is_vlm", "text_config", "vlm_config",
           "install_sharing_vision", "check_sharing_vision", "check_release",
           "vlm_release_problem", "inner_model",
           "MIN_TRANSFORMERS"]

# model type -> the text family of the same shape (models.hf_config builds it)
TEXT_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe",
                "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
VLM_FAMILIES: tuple[str, ...] = tuple(TEXT_FAMILY)
_CONFIG_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLConfig", "qwen3_vl": "Qwen3VLConfig",
                   "qwen3_vl_moe": "Qwen3VLMoeConfig", "qwen3_5": "Qwen3_5Config",
                   "qwen3_5_moe": "Qwen3_5MoeConfig"}
# the oldest transformers tested (verl 0.9.1's); 4.x's get_rope_index reads the placeholders
# itself and its configs file mrope under rope_scaling
MIN_TRANSFORMERS = (5, 10)
IMAGE_ROWS_KWARG = "sharing_image_rows"  # forward keyword: feature row of each placeholder row
# the top ids of the vocabulary: image, video, vision start, vision end
_SPECIAL_IDS = ("image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id")


def is_vlm(model_or_config: Any) -> bool:
    """Whether a model (or config) is one of the :data:`VLM_FAMILIES`."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) in TEXT_FAMILY


def vlm_release_problem(model_type: str) -> str | None:
    """What the ``hf.vlm_release`` refusal names ("<model> on transformers <version>") when the
    installed transformers is older than :data:`MIN_TRANSFORMERS`; ``None`` otherwise."""
    import transformers

    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if release < MIN_TRANSFORMERS:
        return f"{model_type} on transformers {transformers.__version__}"
    return None


def check_release(model_type: str) -> None:
    """Refuses a vision-language model on a transformers older than :data:`MIN_TRANSFORMERS`."""
    problem = vlm_release_problem(model_type)
    if problem:
        raise refuse("hf.vlm_release", problem)


def text_config(config: Any) -> Any:
    """The config the language model reads: ``config.text_config`` for a VLM, else itself."""
    return config.text_config if is_vlm(config) else config


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The ``...Model`` of a ``...ForConditionalGeneration`` (it holds ``get_rope_index``)."""
    return model.model


def vlm_config(family: str, preset: ModelPreset, text_model: Any, **overrides: Any) -> Any:
    """A ``family`` VLM config: ``text_model`` (the config of its :data:`TEXT_FAMILY` of
    ``preset``'s shape, as :func:`~prefix_sharing.fsdp_compat.models.hf_config` builds it)
    as its text config, a 2-block vision tower of
    width 32 on 2x2 patches merged 2x2, and mrope sections over the rotary half-width. The
    image / video / vision-start / vision-end ids are the vocabulary's last four."""
    import transformers

    check_release(family)
    name = _CONFIG_CLASSES[family]
    if not hasattr(transformers, name):
        raise MissingPackageError(f"{family} needs a transformers release with {name} "
                                  f"(installed: {transformers.__version__}); pip install -U "
                                  "transformers")
    text = text_model.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "_name_or_path",
                "rope_theta", "dtype"):
        text.pop(key, None)
    rope = dict(text.get("rope_parameters") or {"rope_type": "default",
                                                 "rope_theta": preset.rotary_base})
    if family.startswith("qwen3_5"):
        rope["partial_rotary_factor"] = 0.5  # 4 rotary frequencies on a 16-wide head
    head_dim = text.get("head_dim") or preset.hidden_size // preset.num_attention_heads
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    side = half * 3 // 8
    rope["mrope_section"] = [half - 2 * side, side, side]
    if family != "qwen2_5_vl":
        rope["mrope_interleaved"] = True
    text["rope_parameters"] = rope
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  out_hidden_size=preset.hidden_size)
    if family == "qwen2_5_vl":
        vision.update(window_size=8, fullatt_block_indexes=[1])
    else:
        vision.update(num_position_embeddings=16)
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        vision["deepstack_visual_indexes"] = [0, 1]
    ids = {key: preset.vocab_size - 1 - i for i, key in enumerate(_SPECIAL_IDS)}
    config = getattr(transformers, name)(
        text_config=text, vision_config=vision, tie_word_embeddings=preset.tie_embeddings,
        **ids, **overrides)
    config.use_cache = False
    return config


def install_sharing_vision(model: torch.nn.Module) -> bool:
    """Switches the inner model of a VLM (in place) to the gathering ``get_image_features``;
    returns whether it did."""
    return is_vlm(model) and _VISION.switch(inner_model(model))


def check_sharing_vision(model: torch.nn.Module) -> None:
    """Raises when ``model``'s inner model still has the stock ``get_image_features`` (it
    would place every distinct image once, not at every placeholder row)."""
    stock = _VISION.stock_left(model)
    if stock:
        raise refuse("hf.stock_vision_features", stock)


def _sharing_get_image_features(self: torch.nn.Module, pixel_values: torch.Tensor,
                                image_grid_thw: torch.Tensor | None = None,
                                **kwargs: Any) -> Any:
    """The stock features of the images given (the micro-batch's distinct images), then, with
    ``sharing_image_rows``, one row per placeholder row of the flat layout, in its order."""
    rows = kwargs.pop(IMAGE_ROWS_KWARG, None)
    out = super(type(self), self).get_image_features(pixel_values, image_grid_thw, **kwargs)
    if rows is None:
        return out
    out.pooler_output = _gathered(out.pooler_output, rows)
    if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL: one entry per level
        out.deepstack_features = [_gathered(level, rows) for level in out.deepstack_features]
    return out


def _gathered(features: torch.Tensor | Sequence[torch.Tensor],
              rows: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor]:
    """``rows`` of ``features``, in its form: per-image pieces (one piece back) or one tensor
    (transformers 5.10's deepstack levels)."""
    if isinstance(features, torch.Tensor):
        return features.index_select(0, rows)
    return (torch.cat(list(features)).index_select(0, rows),)


_VISION = InPlaceSwitch("VLM image-feature models", lambda m: hasattr(m, "get_image_features")
                        and hasattr(m, "get_rope_index"), _sharing_get_image_features,
                        "_prefix_sharing_vision", method="get_image_features")
