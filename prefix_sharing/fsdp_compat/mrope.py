"""Multi-dimensional rotary positions (mrope) of a VLM micro-batch, per computed token.

Qwen2.5-VL / Qwen3-VL / Qwen3.5 rotate queries and keys by three position rows (temporal,
height, width): a text token has its index in all three, an image's placeholders take the
image's grid offsets, and the text after an image jumps past it. The rows of a token depend on
the tokens and images before it only, so every sequence's rows come from the model's own
``get_rope_index`` on that whole sequence, and each computed row of the flat layout takes the
rows its token has in its own sequence (a reuser's tail: the positions it has in its sequence,
not its provider's). Where two sequences' tokens and images agree, so do their rows; a plan
whose computed row would stand for tokens with different rows is refused.
:func:`vision_model_kwargs` gathers what the VLM's forward needs on top of the plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from ..plan import SharingPlan
from .vision import VisionBatch, image_rows
from .vlm import IMAGE_ROWS_KWARG, inner_model

__all__ = ["sequence_positions", "flat_positions", "vision_model_kwargs"]


def vision_model_kwargs(model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                        plan: SharingPlan, batch: VisionBatch) -> dict:
    """The forward keywords of a VLM micro-batch with images, besides the plan's: the
    ``(3, 1, T_flat)`` positions, the distinct images and their grids, and the feature row of
    each placeholder row (see :mod:`.vlm`)."""
    device = plan.input_ids.device
    vision = inner_model(model).visual
    positions = flat_positions(plan, sequence_positions(model, sequences, batch))
    return {"position_ids": positions[:, None].to(device),
            "pixel_values": batch.pixel_values.to(device, vision.dtype),
            "image_grid_thw": batch.image_grid_thw.to(device),
            IMAGE_ROWS_KWARG: image_rows(plan, batch).to(device)}


def sequence_positions(model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                       batch: VisionBatch) -> list[torch.Tensor]:
    """Per sequence, its ``(3, L_i)`` rows from the model's ``get_rope_index`` (the rules
    transformers applies to the whole sequence)."""
    inner = inner_model(model)
    image_token_id = model.config.image_token_id
    out = []
    with torch.no_grad():
        for seq, grid in zip(sequences, batch.grids):
            ids = torch.as_tensor(seq).to("cpu", torch.int64)[None]
            types = (ids == image_token_id).to(torch.int32)
            rows, _ = inner.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
            out.append(rows[:, 0].to(torch.int64))
    return out


def flat_positions(plan: SharingPlan, positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(3, T_flat)`` the rows of every computed token (pad rows: their plan positions).

    Raises when one flat row stands for tokens whose rows disagree, e.g. samples planned as
    sharing a prefix whose images (or grids) differ.
    """
    packed = torch.cat(list(positions), dim=1)
    if packed.shape != (3, plan.num_tokens_total):
        raise InputError(f"positions must be (3, L_i) per sequence, {plan.num_tokens_total} "
                         f"tokens in all; got {tuple(packed.shape)}")
    kv_index = plan.kv_index.cpu()
    flat = plan.position_ids.cpu()[None].repeat(3, 1)
    flat[:, kv_index] = packed
    bad = (flat[:, kv_index] != packed).any(0)
    if bool(bad.any()):
        token = int(bad.nonzero()[0])
        seq = int(torch.searchsorted(plan.cu_seqlens.cpu(), token, right=True)) - 1
        raise InputError(f"sequence {seq}'s mrope positions differ from those of a sequence "
                         f"sharing its prefix (at token {token - int(plan.cu_seqlens[seq])}): "
                         "samples that share tokens must share the images behind them")
    return flat
