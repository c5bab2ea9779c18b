"""Images of a micro-batch for a vision-language model: identity, one encoder call, placement.

verl hands a VLM micro-batch over as token sequences plus, per sequence, its
``multi_modal_inputs`` (``pixel_values``: every patch of its images, concatenated;
``image_grid_thw``: one ``(t, h, w)`` row per image). Here:

- every image is hashed (its pixel bytes, dtype, shape and grid), and each of its placeholder
  tokens is tagged ``(distinct image + 1, index in the image + 1)`` (text tokens ``(0, 0)``).
  The planner takes the tags as part of a token's identity (``build_plan(images=...)``, as it
  takes replayed routes), so two sequences share a prefix only where their tokens *and* the
  images behind their placeholders agree; an image after the branch point belongs to the tail
  that holds it;
- the vision tower runs once, on the micro-batch's distinct images;
- each placeholder row of the flat layout reads its feature row ``offset[image] + index``
  (:func:`image_rows`): a provider's rows get the features, reusers read them through K/V
  injection like any prefix token.

Refused with one clear error each: a placeholder count or run that does not match the grid,
``pixel_values`` without ``image_grid_thw`` (or patches that do not fill the grids),
placeholders without images, and video inputs (refusal ``hf.video``).

A rollout dump names each image by the same digest (:func:`image_hashes`, hex): ``prefix-sharing
analyze`` tags the placeholder runs of its sequences from those names (:func:`hashed_image_tags`)
and plans them as the sharing forward would.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from ..errors import InputError
from ..plan import SharingPlan
from ..refusals import refuse

__all__ = ["VisionBatch", "ImageTags", "vision_batch", "image_hashes", "hashed_image_tags",
           "vision_metrics", "flat_tags", "image_rows"]

_VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@dataclasses.dataclass(frozen=True)
class VisionBatch:
    """The images of one micro-batch.

    Attributes:
        tags: per sequence, ``(L_i, 2)`` int64 placeholder tags (the planner's ``images=``).
        grids: per sequence, its images' ``(n_i, 3)`` grids (``None`` without images), for
            the positions (:mod:`.mrope`).
        pixel_values: the distinct images' patches, concatenated (what the encoder runs on).
        image_grid_thw: ``(D, 3)`` the distinct images' grids, in that order.
        feature_offsets: ``(D,)`` each distinct image's first row in the encoder's output.
        images_total: images over all sequences (what the plain forward encodes).
    """

    tags: list[torch.Tensor]
    grids: list[torch.Tensor | None]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    feature_offsets: torch.Tensor
    images_total: int

    @property
    def images_computed(self) -> int:
        """Images the encoder runs on: the distinct ones."""
        return int(self.feature_offsets.numel())

    def metrics(self, plan: SharingPlan, prefix: str = "prefix_sharing/") -> dict[str, float]:
        """Images and image tokens: what the plain forward encodes and computes, and what
        ``plan`` does (``vision_images_total`` / ``_computed``, ``vision_tokens_total`` /
        ``_computed``)."""
        return vision_metrics(plan, self.tags, self.images_total, self.images_computed, prefix)


@dataclasses.dataclass(frozen=True)
class ImageTags:
    """A rollout dump's images, named by their hashes (:func:`hashed_image_tags`).

    Attributes:
        tags: per sequence, ``(L_i, 2)`` int64 placeholder tags (the planner's ``images=``).
        images_total: images over all sequences.
        images_distinct: distinct hashes (the images the sharing forward's encoder runs on).
    """

    tags: list[torch.Tensor]
    images_total: int
    images_distinct: int

    def metrics(self, plan: SharingPlan, prefix: str = "") -> dict[str, float]:
        """As :meth:`VisionBatch.metrics`."""
        return vision_metrics(plan, self.tags, self.images_total, self.images_distinct, prefix)


def vision_metrics(plan: SharingPlan, tags: Sequence[torch.Tensor], images_total: int,
                   images_computed: int, prefix: str = "prefix_sharing/") -> dict[str, float]:
    """Images and image tokens: what the plain forward encodes and computes (every image, every
    placeholder token), and what ``plan`` does (the distinct images; each placeholder row it
    computes once)."""
    placeholders = torch.cat(list(tags))[:, 0] > 0
    rows = plan.kv_index.cpu()[placeholders]
    return {f"{prefix}vision_images_total": float(images_total),
            f"{prefix}vision_images_computed": float(images_computed),
            f"{prefix}vision_tokens_total": float(rows.numel()),
            f"{prefix}vision_tokens_computed": float(rows.unique().numel())}


def vision_batch(config: object, sequences: Sequence[torch.Tensor],
                 multi_modal_inputs: Sequence[Mapping | None] | None) -> VisionBatch | None:
    """Checks ``multi_modal_inputs`` against the placeholders of ``sequences``; ``None`` when
    the micro-batch holds no image (then it is planned and run as text).

    Args:
        config: the VLM's config (``image_token_id``, ``video_token_id``, the vision config's
            ``spatial_merge_size``).
        sequences: the micro-batch's token ids.
        multi_modal_inputs: one dict (``pixel_values``, ``image_grid_thw``) or ``None`` per
            sequence; ``None`` for a text-only micro-batch.
    """
    if multi_modal_inputs is not None and len(multi_modal_inputs) != len(sequences):
        raise InputError(f"multi_modal_inputs must hold one entry (a dict or None) per sequence "
                         f"({len(sequences)}); got {len(multi_modal_inputs)}")
    merge = config.vision_config.spatial_merge_size
    distinct: dict[bytes, int] = {}
    pixels, grids_d, offsets = [], [], []
    tags, grids, total, rows = [], [], 0, 0
    for i, seq in enumerate(sequences):
        ids = torch.as_tensor(seq).to("cpu", torch.int64)
        if bool((ids == config.video_token_id).any()):
            raise refuse("hf.video", f"sequence {i} holds video placeholder tokens "
                         f"(video_token_id={config.video_token_id})")
        mm = None if multi_modal_inputs is None else multi_modal_inputs[i]
        images = _images(i, ids, mm, config.image_token_id, merge)
        keys = [_digest(pixel, grid) for _, _, pixel, grid in images]
        for key, (_, count, pixel, grid) in zip(keys, images):
            if key not in distinct:
                distinct[key] = len(distinct)
                pixels.append(pixel)
                grids_d.append(grid)
                offsets.append(rows)
                rows += count
        total += len(images)
        tags.append(_tags(ids.numel(), [(a, n) for a, n, *_ in images],
                          [distinct[key] for key in keys]))
        grids.append(torch.stack([g for *_, g in images]) if images else None)
    if not distinct:
        return None
    return VisionBatch(tags, grids, torch.cat(pixels), torch.stack(grids_d),
                       torch.tensor(offsets, dtype=torch.int64), total)


def _images(i: int, ids: torch.Tensor, mm: Mapping | None, image_token_id: int,
            merge: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(first placeholder, placeholder count, patches, grid)`` of each image of sequence
    ``i``, in order; checks them against its placeholder runs."""
    runs = _placeholder_runs(ids == image_token_id)
    pieces = _pieces(i, mm)
    if not pieces:
        if runs:
            raise InputError(f"sequence {i} holds {sum(n for _, n in runs)} image placeholder "
                             f"tokens (image_token_id={image_token_id}) but no pixel_values")
        return []
    grid = torch.stack([g for _, g in pieces])
    counts = (grid.prod(-1) // merge**2).tolist()
    if [n for _, n in runs] != counts:
        raise InputError(
            f"sequence {i}: its image placeholder runs hold {[n for _, n in runs]} tokens but "
            f"image_grid_thw {grid.tolist()} (spatial merge {merge}) needs {counts}, one run "
            "per image in order")
    return [(start, n, piece, g) for (start, n), (piece, g) in zip(runs, pieces)]


def _pieces(i: int, mm: Mapping | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(patches, grid)`` of each image of sample ``i``'s ``multi_modal_inputs``, in order."""
    mm = dict(mm or {})
    video = [k for k in _VIDEO_KEYS if mm.get(k) is not None]
    if video:
        raise refuse("hf.video", f"sequence {i}'s multi_modal_inputs hold {', '.join(video)}")
    unknown = sorted(k for k in mm if k not in _IMAGE_KEYS and k not in _VIDEO_KEYS)
    if unknown:
        raise InputError(f"sequence {i}'s multi_modal_inputs hold {', '.join(unknown)}; only "
                         f"{', '.join(_IMAGE_KEYS)} are understood")
    pixel_values, grid = mm.get("pixel_values"), mm.get("image_grid_thw")
    if pixel_values is None:
        if grid is not None:
            raise InputError(f"sequence {i} has image_grid_thw but no pixel_values")
        return []
    if grid is None:
        raise InputError(f"sequence {i} has pixel_values but no image_grid_thw: the grid says "
                         "how its patches form images")
    grid = torch.as_tensor(grid).to("cpu", torch.int64).reshape(-1, 3)
    patches = grid.prod(-1)
    if int(patches.sum()) != pixel_values.size(0):
        raise InputError(f"sequence {i}: pixel_values has {pixel_values.size(0)} patches but "
                         f"image_grid_thw {grid.tolist()} makes {int(patches.sum())}")
    return list(zip(torch.split(pixel_values, patches.tolist()), grid))


def image_hashes(multi_modal_inputs: Mapping | None) -> list[str]:
    """The hex digest of each image of one sample's ``multi_modal_inputs`` (verl's per-sample
    layout: ``pixel_values``, ``image_grid_thw``), in order: what a rollout dump's
    ``image_hashes`` holds for ``prefix-sharing analyze``, and the identity the sharing forward
    gives the image (its pixel bytes, dtype, shape and grid)."""
    return [_digest(piece, grid).hex() for piece, grid in _pieces(0, multi_modal_inputs)]


def hashed_image_tags(sequences: Sequence[torch.Tensor], image_token_id: int,
                      hashes: Sequence[Sequence[str]],
                      where: Callable[[int], str] = "sequence {}".format) -> ImageTags:
    """The placeholder tags of a micro-batch whose images are known by name only: sequence
    ``i``'s placeholder runs (of ``image_token_id``) are its ``hashes[i]``, in order; equal
    hashes are one image. ``where(i)`` names sequence ``i`` in errors.

    Raises:
        InputError: a sequence whose hashes do not match its placeholder runs one to one, or
            one hash with runs of different lengths (one image has one token count).
    """
    distinct: dict[str, tuple[int, int]] = {}  # hash -> (index, placeholder count)
    tags, total = [], 0
    for i, (seq, names) in enumerate(zip(sequences, hashes)):
        ids = torch.as_tensor(seq).to("cpu", torch.int64)
        runs = _placeholder_runs(ids == image_token_id)
        if len(runs) != len(names):
            raise InputError(f"{where(i)}: {len(names)} image hashes but {len(runs)} runs of "
                             f"image placeholder tokens (id {image_token_id}); one hash per "
                             "run, in order")
        for name, (_, n) in zip(names, runs):
            index, count = distinct.setdefault(name, (len(distinct), n))
            if count != n:
                raise InputError(f"{where(i)}: image {name} has {n} placeholder tokens here "
                                 f"but {count} before; one image has one token count")
        tags.append(_tags(ids.numel(), runs, [distinct[name][0] for name in names]))
        total += len(names)
    return ImageTags(tags, total, len(distinct))


def _tags(length: int, runs: Sequence[tuple[int, int]], images: Sequence[int]) -> torch.Tensor:
    """``(length, 2)`` tags of one sequence: run ``k`` holds distinct image ``images[k]``."""
    tag = torch.zeros(length, 2, dtype=torch.int64)
    for (start, count), image in zip(runs, images):
        tag[start:start + count, 0] = image + 1
        tag[start:start + count, 1] = torch.arange(1, count + 1)
    return tag


def _placeholder_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of each contiguous run of placeholder tokens."""
    flags = np.concatenate([[False], mask.numpy(), [False]])
    edges = np.flatnonzero(flags[1:] != flags[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def _digest(pixel: torch.Tensor, grid: torch.Tensor) -> bytes:
    """The image's identity: its pixel bytes, dtype, shape and grid."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{pixel.dtype}{tuple(pixel.shape)}{grid.tolist()}".encode())
    h.update(pixel.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def flat_tags(plan: SharingPlan, batch: VisionBatch) -> torch.Tensor:
    """``(T_flat, 2)`` the tag of each flat row; raises when the plan computes one row for
    tokens of different images (a plan built without ``images=``)."""
    packed = torch.cat(batch.tags)
    kv_index = plan.kv_index.cpu()
    flat = torch.zeros(plan.num_tokens_flat, 2, dtype=torch.int64)
    flat[kv_index] = packed
    bad = (flat[kv_index] != packed).any(-1)
    if bool(bad.any()):
        seq = int(torch.searchsorted(plan.cu_seqlens.cpu(), bad.nonzero()[0], right=True)) - 1
        raise InputError(f"the plan shares a prefix of sequence {seq} across different images: "
                         "build it with build_plan(..., images=vision_batch(...).tags)")
    return flat


def image_rows(plan: SharingPlan, batch: VisionBatch) -> torch.Tensor:
    """For each placeholder row of the flat layout (in order), its row of the encoder's
    output on the distinct images."""
    tags = flat_tags(plan, batch)
    tags = tags[tags[:, 0] > 0]
    return batch.feature_offsets[tags[:, 0] - 1] + tags[:, 1] - 1
