"""Reads a rollout dump into a micro-batch: the sequences, and their prompt groups when known.

The ``analyze`` command (and, later, ``verify`` and ``bench``) reads the user's own rollouts,
so all of them accept the same files:

- **JSON Lines** (``.jsonl``, or ``.json`` holding one JSON object per line; blank lines are
  skipped) or **Parquet** (``.parquet``, verl-style dumps; needs ``pyarrow``, imported only
  when such a file is read).
- One rollout per line / row, either as ``input_ids`` (the whole sequence) or as
  ``prompt_ids`` + ``response_ids`` (the sequence is their concatenation). When both are
  present, ``prompt_ids`` + ``response_ids`` are used: only they say where the prompt ends.
  Ids are non-negative integers; Parquet columns must be lists of integers.
- With ``prompt_ids``, the prompt groups (for ``mode="prompt_only"``) are the rows of one
  ``uid`` when that column exists (every member must have the same prompt), else the rows
  with identical prompt ids.
- Optionally ``routed_experts`` (verl's name), the routes recorded for MoE routing replay: per
  row one nested list ``[tokens][moe_layers][topk]`` of expert ids, one entry per token of the
  whole sequence, the same ``moe_layers`` and ``topk`` in every row.
- Optionally ``image_hashes`` (a vision-language dump): per row a list of strings, one per run
  of image placeholder tokens in the sequence, in order (missing, null or ``[]``: a text-only
  row). A hash names the image: equal hashes are one image, whose tokens are then shared like
  any prefix's, and token-identical prompts over different hashes are not.
  :func:`prefix_sharing.fsdp_compat.vision.image_hashes` computes them from a sample's
  ``multi_modal_inputs`` the way the sharing forward identifies images. Placing them needs the
  placeholder token id (``load_rollouts(..., image_token_id=)``; the model config's
  ``image_token_id``).

Every problem with the file raises :class:`RolloutError` (a ``ValueError``) whose one-line
message names the file and, where it can, the line (JSON Lines, counted from 1) or row
(Parquet, counted from 0, like the sequence indices).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .planner import PromptGroup

if TYPE_CHECKING:
    from .fsdp_compat.vision import ImageTags

__all__ = ["Rollouts", "RolloutError", "load_rollouts"]

_JSON_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_INPUT = ("input_ids",)
_PROMPT_RESPONSE = ("prompt_ids", "response_ids")
_ROUTES = "routed_experts"
_IMAGES = "image_hashes"


class RolloutError(ValueError):
    """A rollout file that cannot be read as a micro-batch; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """The micro-batch of a rollout file.

    Attributes:
        sequences: one 1-D int64 tensor of token ids per row, in file order.
        groups: the prompt groups (``prompt_only`` mode), or ``None`` when the file has
            ``input_ids`` only and so does not say where prompts end.
        routes: the recorded routes (``routed_experts``), one int64 tensor
            ``[tokens, moe_layers, topk]`` per row, or ``None`` when the file has none.
        images: the images behind the placeholder runs (``image_hashes``, placed by
            ``image_token_id``), or ``None`` when no ``image_token_id`` was given.
    """

    sequences: list[torch.Tensor]
    groups: list[PromptGroup] | None
    routes: list[torch.Tensor] | None = None
    images: ImageTags | None = None


@dataclasses.dataclass(frozen=True)
class _Table:
    """Validated id columns of a file, and where each row came from (for error messages)."""

    ids: dict[str, list[np.ndarray]]
    uids: list[object] | None
    where: Callable[[int], str]
    routes: list[object] | None = None  # each row's routed_experts as read, unchecked
    images: list[object] | None = None  # each row's image_hashes as read, unchecked


def load_rollouts(path: str | Path, image_token_id: int | None = None) -> Rollouts:
    """Reads a JSON Lines or Parquet rollout file (see the module docstring for the format).

    Args:
        path: the file.
        image_token_id: the image placeholder token id of a vision-language dump: each row's
            ``image_hashes`` name its placeholder runs (``Rollouts.images``). A file with
            ``image_hashes`` needs it.

    Raises:
        FileNotFoundError: no such file.
        RolloutError: an unsupported file type, missing columns, ids that are not flat lists
            of non-negative integers, no rows, or an empty sequence; image hashes without
            ``image_token_id``, or not one per placeholder run.
        ImportError: a Parquet file without ``pyarrow`` installed.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in _JSON_SUFFIXES:
        table = _read_jsonl(path)
    elif suffix in _PARQUET_SUFFIXES:
        table = _read_parquet(path)
    else:
        raise RolloutError(
            f"{path}: unsupported file type {suffix or '(no suffix)'!r}; "
            "expected .jsonl / .json (JSON Lines) or .parquet"
        )
    return _rollouts(table, path, image_token_id)


def _schema(path: Path, columns: Sequence[str]) -> tuple[str, ...]:
    """The id columns a file's rows are read from, decided by the columns it has."""
    if "prompt_ids" in columns or "response_ids" in columns:
        present = [c for c in _PROMPT_RESPONSE if c in columns]
        if len(present) == 1:
            missing = next(c for c in _PROMPT_RESPONSE if c not in columns)
            raise RolloutError(f"{path}: has a {present[0]} column but no {missing}")
        return _PROMPT_RESPONSE
    if "input_ids" in columns:
        return _INPUT
    found = ", ".join(columns) if columns else "none"
    raise RolloutError(
        f"{path}: needs an input_ids column, or prompt_ids and response_ids; found: {found}"
    )


def _rollouts(table: _Table, path: Path, image_token_id: int | None) -> Rollouts:
    if "input_ids" in table.ids:
        sequences, groups = table.ids["input_ids"], None
    else:
        prompts, responses = table.ids["prompt_ids"], table.ids["response_ids"]
        sequences = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
        groups = _prompt_groups(prompts, table.uids, table.where)
    for i, seq in enumerate(sequences):
        if seq.size == 0:
            raise RolloutError(f"{table.where(i)}: the sequence is empty (no token ids)")
    routes = None if table.routes is None else _routes(table.routes, sequences, table.where)
    tensors = [torch.from_numpy(s) for s in sequences]
    return Rollouts(tensors, groups, routes, _images(table, path, tensors, image_token_id))


def _images(table: _Table, path: Path, sequences: list[torch.Tensor],
            image_token_id: int | None) -> ImageTags | None:
    """The rows' ``image_hashes`` placed on their placeholder runs (none: text-only rows)."""
    if image_token_id is None:
        if table.images is not None:
            raise RolloutError(f"{path}: has {_IMAGES} (a vision-language dump), which only "
                               "analyze reads, given the placeholder id: --image-token-id N "
                               "(the model config's image_token_id)")
        return None
    from .fsdp_compat.vision import hashed_image_tags

    hashes = [_hashes(value, table.where(i))
              for i, value in enumerate(table.images or [None] * len(sequences))]
    try:
        return hashed_image_tags(sequences, image_token_id, hashes, table.where)
    except ValueError as error:
        raise RolloutError(str(error)) from None


def _hashes(value: object, where: str) -> list[str]:
    """A row's image hashes: a list of non-empty strings (missing or null: none)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(h, str) and h for h in value):
        raise RolloutError(f"{where}: {_IMAGES} must be a list of image hashes (non-empty "
                           f"strings), one per image placeholder run; got {_short(value)}")
    return value


def _routes(rows: list[object], sequences: list[np.ndarray],
            where: Callable[[int], str]) -> list[torch.Tensor]:
    """Each row's ``routed_experts`` as ``[tokens, moe_layers, topk]`` int64, checked."""
    out, shape = [], None
    for i, (value, seq) in enumerate(zip(rows, sequences)):
        try:
            routes = np.asarray(value)
        except ValueError:  # ragged nesting
            routes = np.empty(0, dtype=object)
        if routes.ndim != 3 or routes.dtype.kind not in "iu" or (routes < 0).any():
            raise RolloutError(f"{where(i)}: {_ROUTES} must be a [tokens][moe_layers][topk] "
                               "nested list of expert ids >= 0")
        if routes.shape[0] != seq.size or (shape is not None and routes.shape[1:] != shape):
            expected = f"({seq.size}, " + (f"{shape[0]}, {shape[1]})" if shape else "L, k)")
            raise RolloutError(f"{where(i)}: {_ROUTES} has shape {routes.shape}; expected "
                               f"{expected}: one entry per token, the same layers and top-k "
                               "in every row")
        shape = routes.shape[1:]
        out.append(torch.from_numpy(routes.astype(np.int64)))
    return out


def _prompt_groups(
    prompts: list[np.ndarray], uids: list[object] | None, where: Callable[[int], str]
) -> list[PromptGroup]:
    """Rows of one uid (each with the same prompt), or rows with identical prompts."""
    keys = uids if uids is not None else [p.tobytes() for p in prompts]
    members: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    for key, rows in members.items():
        first = prompts[rows[0]]
        for i in rows[1:]:
            if not np.array_equal(prompts[i], first):
                raise RolloutError(
                    f"{where(i)}: uid {key!r} has a different prompt than {where(rows[0])}"
                )
    return [PromptGroup(prompts[rows[0]].size, rows) for rows in members.values()]


# --------------------------------------------------------------------------- JSON Lines
def _read_jsonl(path: Path) -> _Table:
    records, lines = _json_records(path)

    def where(i: int) -> str:
        return f"{path} line {lines[i]}"

    schema = _schema(path, list(records[0]))
    use_uid = "uid" in records[0] and schema == _PROMPT_RESPONSE
    for i, record in enumerate(records):
        missing = [c for c in schema + ("uid",) * use_uid if c not in record]
        if missing:
            raise RolloutError(f"{where(i)}: missing {missing[0]} (line {lines[0]} has it)")
    ids = {c: [_json_ids(r[c], c, where(i)) for i, r in enumerate(records)] for c in schema}
    uids = [_uid(r["uid"], where(i)) for i, r in enumerate(records)] if use_uid else None
    routes = [r.get(_ROUTES) for r in records] if _ROUTES in records[0] else None
    images = [r.get(_IMAGES) for r in records] if any(_IMAGES in r for r in records) else None
    return _Table(ids, uids, where, routes, images)


def _json_records(path: Path) -> tuple[list[dict], list[int]]:
    """The JSON object of every non-blank line, and its line number (from 1)."""
    records, lines = [], []
    try:
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if line.strip():
                    records.append(_json_object(line, f"{path} line {number}"))
                    lines.append(number)
    except UnicodeDecodeError:
        raise RolloutError(f"{path}: not UTF-8 text, so not JSON Lines") from None
    if not records:
        raise RolloutError(f"{path}: no rollouts (the file is empty)")
    return records, lines


def _json_object(line: str, where: str) -> dict:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise RolloutError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise RolloutError(
            f"{where}: expected a JSON object (one rollout per line); got {type(value).__name__}"
        )
    return value


def _json_ids(value: object, column: str, where: str) -> np.ndarray:
    """A JSON list of token ids as int64; booleans, floats and nested lists are refused."""
    if not isinstance(value, list):
        raise RolloutError(f"{where}: {column} must be a list of integers; got {_short(value)}")
    if not all(type(v) is int and v >= 0 for v in value):
        k, bad = next((k, v) for k, v in enumerate(value) if not (type(v) is int and v >= 0))
        reason = "token ids must be >= 0" if type(bad) is int else "not an integer token id"
        raise RolloutError(f"{where}: {column}[{k}] is {_short(bad)}; {reason}")
    try:
        return np.array(value, dtype=np.int64)
    except OverflowError:
        raise RolloutError(f"{where}: {column} has a token id beyond int64") from None


def _uid(value: object, where: str) -> object:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RolloutError(f"{where}: uid must be a string or an integer; got {_short(value)}")
    return value


def _short(value: object, limit: int = 40) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- Parquet
def _read_parquet(path: Path) -> _Table:
    pa = _import_pyarrow()
    try:
        data = pa.parquet.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise RolloutError(f"{path}: not a readable Parquet file ({error})") from None

    def where(i: int) -> str:
        return f"{path} row {i}"

    if data.num_rows == 0:
        raise RolloutError(f"{path}: no rollouts (the table has no rows)")
    schema = _schema(path, data.column_names)
    ids = {c: _parquet_ids(pa, data.column(c).combine_chunks(), c, path, where) for c in schema}
    uids = None
    if "uid" in data.column_names and schema == _PROMPT_RESPONSE:
        uids = [_uid(u, where(i)) for i, u in enumerate(data.column("uid").to_pylist())]
    routes = data.column(_ROUTES).to_pylist() if _ROUTES in data.column_names else None
    images = data.column(_IMAGES).to_pylist() if _IMAGES in data.column_names else None
    return _Table(ids, uids, where, routes, images)


def _import_pyarrow():
    """pyarrow with its parquet and compute modules, imported only when a Parquet file is read."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            "reading Parquet rollouts needs pyarrow: pip install pyarrow "
            "(or pip install 'prefix-sharing[io]')"
        ) from None
    return pyarrow


def _parquet_ids(pa, column, name: str, path: Path, where: Callable[[int], str]) -> list[np.ndarray]:
    """One int64 array per row of a list-of-integers column, checked without a loop per id."""
    if not _is_integer_list(pa, column.type):
        raise RolloutError(
            f"{path}: column {name} must hold lists of integer token ids; its type is {column.type}"
        )
    if column.null_count:
        raise RolloutError(f"{where(_first(column.is_null()))}: {name} is null")
    ends = np.cumsum(pa.compute.list_value_length(column).to_numpy(zero_copy_only=False))
    values = column.flatten()
    if values.null_count:
        row = np.searchsorted(ends, _first(values.is_null()), "right")
        raise RolloutError(f"{where(row)}: {name} holds a null token id")
    values = values.to_numpy().astype(np.int64)
    if values.size and values.min() < 0:
        k = int(np.argmax(values < 0))
        row = np.searchsorted(ends, k, "right")
        raise RolloutError(f"{where(row)}: {name} holds {values[k]}; token ids must be >= 0")
    return np.split(values, ends[:-1])


def _is_integer_list(pa, kind) -> bool:
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    return any(is_list(kind) for is_list in lists) and pa.types.is_integer(kind.value_type)


def _first(mask) -> int:
    """Index of the first True of a boolean Arrow array."""
    return int(mask.to_numpy(zero_copy_only=False).argmax())
