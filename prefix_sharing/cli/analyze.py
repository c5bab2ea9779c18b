"""``prefix-sharing analyze FILE``: what sharing would save on the user's own rollouts.

Reads a rollout file (see :mod:`prefix_sharing.rollouts`), plans it as one micro-batch with the
given options and reports, as text or (``--json``) one JSON object:

- ``tokens_total`` / ``tokens_unique``: tokens of the plain forward / tokens the plan computes;
  ``token_ratio`` is their quotient, ``flop_ratio`` the plain / shared forward+backward FLOPs of
  the ``--model`` preset (:func:`prefix_sharing.flops.count_flops`), and ``planner_ms`` the
  median wall time of 3 ``build_plan`` calls after a first, untimed one.
- ``route_divergent_prefix_tokens`` (only when the file has ``routed_experts``, the routes
  recorded for MoE routing replay): the plan shares a prefix only as far as the routes agree as
  well as the tokens, and this many tokens are computed again because routes differ inside
  token-identical prefixes (``route_divergent_share`` of the tokens a plan of the tokens alone
  would share).
- ``structure``: how the plan shares, in terms of "reads": sequence ``r`` *reads from* sequence
  ``s`` when some token of ``r``'s reused prefix was computed by ``s`` (``s`` owns the flat row
  that ``plan.kv_index`` points to; a chain of reuse is resolved, so this is who computes it).

  - ``sharing_groups``: connected components of two or more sequences under "reads from"
    (either direction); ``largest_sharing_group`` is the size of the largest one (0 if none).
    Two GRPO prompts with 3 responses each are 2 groups of 3.
  - ``longest_shared_prefix``: the largest ``prefix_len`` of any sequence - the most tokens one
    sequence takes from others (a duplicate takes all of its tokens).
  - ``deepest_reuse_chain``: the most "reads from" steps in a row, ``r0`` reads from ``r1``,
    which reads from ``r2``, ... 0 without sharing, 1 for responses reading one prompt, 2 when
    a sequence also reads a branch that itself read the prompt (trees, agent turns).
  - ``sequences_computing_nothing``: sequences whose every token is reused (duplicates and
    strict prefixes of another sequence): they get no query segment at all.

With ``--image-token-id N`` (a vision-language dump: ``image_hashes`` name the images behind
the runs of placeholder token ``N``, see :mod:`prefix_sharing.rollouts`), the plan takes the
images as part of the tokens' identity, as the sharing forward does, and the report adds
``vision_tokens_total`` / ``vision_tokens_computed`` (placeholder tokens of the plain forward /
that the plan computes) and ``vision_images_total`` / ``vision_images_computed`` (images the
plain forward encodes / distinct images, which the sharing forward encodes once each).

With ``--dp N``, ``data_parallel`` gives the tokens each of N data-parallel ranks would compute
under verl's stock balancing and under the sharing-aware partitioner, and the ideal
(:mod:`prefix_sharing.cli.analyze_dp`).

``--record FILE.json`` also saves the run as a result file of the benchmarks page
(:func:`prefix_sharing.cli.record.write_result`).

For at most :data:`TREE_LIMIT` sequences the text report draws the plan's prefix tree: the
computed tokens form a forest (each token's parent is the token before it), drawn compressed
(a radix tree): every edge is a run of tokens computed once, labelled with its length and how
many sequences run through it, and ``seq i`` marks the edge where sequence ``i`` ends. The
edge lengths add up to ``tokens_unique``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..batching.groups import connected_components
from ..config import MODES, PrefixSharingConfig
from ..flops import count_flops
from ..plan import SharingPlan
from ..planner import PromptGroup, build_plan
from ..presets import PRESETS, get_preset
from ..rollouts import Rollouts
from ..errors import InputError
from .analyze_dp import data_parallel_report, data_parallel_text
from .record import write_result
from .options import read_rollouts, sharing_config, user_input

__all__ = ["TREE_LIMIT", "sharing_structure", "prefix_tree"]

TREE_LIMIT = 32  # above this many sequences the tree no longer fits on a screen
DEFAULT_MODEL = "qwen2.5-0.5b"
_TIMED_RUNS = 3


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    defaults = PrefixSharingConfig()
    parser = subparsers.add_parser(
        "analyze",
        help="show what sharing would save on a rollout file (.jsonl or .parquet)",
        description="Plan a rollout file as one micro-batch and report the tokens and FLOPs "
        "that sharing saves, and how the sequences share.",
    )
    parser.add_argument(
        "file", metavar="FILE",
        help="JSON Lines (.jsonl/.json) or Parquet with input_ids, or prompt_ids + response_ids "
        "(+ uid), one rollout per line / row",
    )
    parser.add_argument("--mode", default=defaults.mode,
                        help=f"{', '.join(MODES)} (default: %(default)s)")
    parser.add_argument("--min-prefix-len", type=int, default=defaults.min_prefix_len,
                        metavar="N",
                        help="share only prefixes at least this long (default: %(default)s)")
    parser.add_argument("--min-group-size", type=int, default=defaults.min_group_size,
                        metavar="N",
                        help="share only prefixes held by at least this many sequences "
                        "(default: %(default)s)")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="PRESET",
                        help=f"model shape for the FLOP count: {', '.join(PRESETS)} "
                        "(default: %(default)s)")
    parser.add_argument("--dp", type=int, default=None, metavar="N",
                        help="also report the tokens each of N data-parallel ranks computes, "
                        "under verl's stock balancing (that row needs verl installed: it calls "
                        "verl's own partition function) and the sharing-aware one")
    parser.add_argument("--image-token-id", type=int, default=None, metavar="N",
                        help="a vision-language dump: the image placeholder token id (the "
                        "model config's image_token_id); each row's image_hashes name its runs "
                        "of it, and images enter the tokens' identity")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the report")
    parser.add_argument("--record", metavar="FILE.json",
                        help="also save the run as a result file (docs/results/NAME.json: the "
                        "command, date, machine, versions, the report and its JSON)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = sharing_config(args)
    model = get_preset(args.model)  # before reading: a typo should not wait for a big file
    if args.image_token_id is not None and args.image_token_id < 0:
        raise InputError(f"--image-token-id must be a token id >= 0; got {args.image_token_id}")
    rollouts = read_rollouts(args.file, args.image_token_id)
    plan, planner_ms = _timed_plan(rollouts, config, args.file)
    report = {
        "file": args.file,
        "sequences": plan.num_sequences,
        "tokens_total": plan.num_tokens_total,
        "tokens_unique": plan.num_tokens_unique,
        "token_ratio": plan.token_ratio,
        "flop_ratio": count_flops(plan, model).ratio,
        "planner_ms": round(planner_ms, 3),
        "model": model.name,
        "mode": config.mode,
        "min_prefix_len": config.min_prefix_len,
        "min_group_size": config.min_group_size,
        "structure": sharing_structure(plan),
    }
    if rollouts.routes is not None:
        report.update(_route_figures(plan))
    if rollouts.images is not None:
        report.update({k: int(v) for k, v in rollouts.images.metrics(plan).items()})
    if args.dp is not None:
        report["data_parallel"] = data_parallel_report(rollouts, config, args.dp)
    text = "\n".join(_text(report, plan))
    print(json.dumps(report) if args.json else text)
    if args.record:
        write_result(args.record, args.argv, f"analyze {Path(args.file).name}", report, text)
    return 0


def _timed_plan(
    rollouts: Rollouts, config: PrefixSharingConfig, path: str
) -> tuple[SharingPlan, float]:
    """The plan, and the median milliseconds of the planner once warmed up.

    The first call pays one-off costs (lazy imports, allocator warm-up) that a training loop
    pays once, so it is left out of the timing.
    """
    groups = _groups(rollouts, config, path)
    images = None if rollouts.images is None else rollouts.images.tags
    with user_input(ValueError):  # what the planner refuses in the file (ids out of range)
        plan = build_plan(rollouts.sequences, config, groups=groups, routes=rollouts.routes,
                          images=images)
    times = []
    for _ in range(_TIMED_RUNS):
        start = time.perf_counter()
        build_plan(rollouts.sequences, config, groups=groups, routes=rollouts.routes,
                   images=images)
        times.append((time.perf_counter() - start) * 1e3)
    return plan, statistics.median(times)


def _groups(rollouts: Rollouts, config: PrefixSharingConfig, path: str) -> list[PromptGroup] | None:
    """The prompt groups ``prompt_only`` needs; other modes find the sharing themselves."""
    if config.mode != "prompt_only":
        return None
    if rollouts.groups is None:
        raise InputError(
            f"--mode prompt_only shares prompts, but {path} has input_ids only: "
            "give prompt_ids and response_ids (and uid) to say where prompts end"
        )
    return rollouts.groups


def _route_figures(plan: SharingPlan) -> dict[str, float]:
    """What diverging recorded routes cost: tokens computed again, and their share of the
    tokens the tokens alone would let the plan share."""
    divergent = plan.route_divergent_prefix_tokens
    shared_by_tokens = plan.num_tokens_total - plan.num_tokens_unique + divergent
    return {"route_divergent_prefix_tokens": divergent,
            "route_divergent_share": divergent / shared_by_tokens if shared_by_tokens else 0.0}


# --------------------------------------------------------------------------- structure
def sharing_structure(plan: SharingPlan) -> dict[str, int]:
    """The sharing figures of the module docstring, for one plan."""
    reads = _reads(plan)
    groups = _group_sizes(plan.num_sequences, reads)
    return {
        "sharing_groups": len(groups),
        "largest_sharing_group": max(groups, default=0),
        "longest_shared_prefix": max(plan.prefix_lens),
        "deepest_reuse_chain": _deepest_chain(plan, reads),
        "sequences_computing_nothing": sum(
            p == n for p, n in zip(plan.prefix_lens, plan.seq_lens)
        ),
    }


def _token_coords(plan: SharingPlan) -> tuple[np.ndarray, np.ndarray]:
    """For every token of every sequence (``kv_index`` order): its sequence and position."""
    lengths = np.asarray(plan.seq_lens)
    seq = np.repeat(np.arange(lengths.size), lengths)
    starts = np.cumsum(lengths) - lengths
    return seq, np.arange(seq.size) - starts[seq]


def _reads(plan: SharingPlan) -> np.ndarray:
    """``(k, 2)`` unique (reader, provider) pairs: reader reuses a token provider computed."""
    seq, pos = _token_coords(plan)
    kv = plan.kv_index.numpy()
    owned = pos >= np.asarray(plan.prefix_lens)[seq]
    computed_by = np.empty(plan.num_tokens_flat, dtype=np.int64)
    computed_by[kv[owned]] = seq[owned]
    pairs = np.stack([seq[~owned], computed_by[kv[~owned]]], axis=1)
    return np.unique(pairs, axis=0)


def _group_sizes(n: int, reads: np.ndarray) -> list[int]:
    """Sizes of the connected components of >= 2 sequences under the reads."""
    return [len(c) for c in connected_components(n, reads.tolist()) if len(c) > 1]


def _deepest_chain(plan: SharingPlan, reads: np.ndarray) -> int:
    """Longest path of "reads from" steps.

    A provider computed a token of the reader's prefix, at or after its own prefix, so its
    prefix is strictly shorter: taking readers by increasing prefix length visits every
    provider's depth before it is used (the graph has no cycles).
    """
    prefix = np.asarray(plan.prefix_lens)
    depth = np.zeros(plan.num_sequences, dtype=np.int64)
    for reader, provider in reads[np.argsort(prefix[reads[:, 0]], kind="stable")].tolist():
        depth[reader] = max(depth[reader], depth[provider] + 1)
    return int(depth.max())


# --------------------------------------------------------------------------- prefix tree
@dataclasses.dataclass
class _Edge:
    """A run of tokens computed once, shared by ``sequences`` sequences; ``ends`` end after it."""

    tokens: int
    sequences: int
    first_sequence: int
    ends: list[int] = dataclasses.field(default_factory=list)
    children: list[_Edge] = dataclasses.field(default_factory=list)


def prefix_tree(plan: SharingPlan) -> list[str]:
    """The plan's computed tokens as a radix tree drawn with box characters, one edge a line::

        ├─ 20 tokens, shared by 3
        │  ├─ 5 tokens: seq 0
        │  └─ 7 tokens: seq 2
        └─ 12 tokens: seq 3
    """
    lines: list[str] = []
    _draw(_radix_tree(plan), "", lines)
    return lines


def _radix_tree(plan: SharingPlan) -> list[_Edge]:
    """The root edges of the forest of computed rows, chains without branch or end merged.

    A row starts a new edge when it has no parent, or its parent has another child or ends a
    sequence. Any other row is not the first of its owner's tail (that one's parent belongs to
    another sequence, which also goes on or ends there), so its parent is the flat row just
    before it: edges are runs of consecutive flat rows, cut at the rows that start one.
    """
    seq, pos = _token_coords(plan)
    kv, rows = plan.kv_index.numpy(), plan.num_tokens_unique
    parent = np.full(rows, -1, dtype=np.int64)
    inner = np.flatnonzero(pos > 0)
    parent[kv[inner]] = kv[inner - 1]
    last_rows = kv[np.cumsum(plan.seq_lens) - 1]
    is_end = np.zeros(rows, dtype=bool)
    is_end[last_rows] = True
    child = parent >= 0
    children = np.bincount(parent[child], minlength=rows)
    starts = ~child
    starts[child] = (children[parent[child]] != 1) | is_end[parent[child]]
    first_rows = np.flatnonzero(starts)
    edge_of = np.cumsum(starts) - 1
    first_seq = np.full(rows, plan.num_sequences, dtype=np.int64)
    np.minimum.at(first_seq, kv, seq)
    through = np.bincount(kv, minlength=rows)

    lengths = np.diff(np.append(first_rows, rows))
    edges = [_Edge(int(n), int(through[r]), int(first_seq[r])) for r, n in zip(first_rows, lengths)]
    for s, row in enumerate(last_rows.tolist()):
        edges[edge_of[row]].ends.append(s)
    roots: list[_Edge] = []
    for edge, row in zip(edges, first_rows.tolist()):
        (edges[edge_of[parent[row]]].children if parent[row] >= 0 else roots).append(edge)
    return roots


def _draw(edges: list[_Edge], indent: str, lines: list[str]) -> None:
    edges = sorted(edges, key=lambda e: e.first_sequence)  # read in the file's order
    for i, edge in enumerate(edges):
        last = i == len(edges) - 1
        lines.append(f"{indent}{'└─' if last else '├─'} {_label(edge)}")
        _draw(edge.children, indent + ("   " if last else "│  "), lines)


def _label(edge: _Edge) -> str:
    text = f"{edge.tokens} token{'s' if edge.tokens != 1 else ''}"
    if edge.sequences > 1:
        text += f", shared by {edge.sequences}"
    if edge.ends:
        text += ": seq " + ", ".join(map(str, edge.ends))
    return text


# --------------------------------------------------------------------------- text report
def _text(report: dict[str, Any], plan: SharingPlan) -> list[str]:
    s = report["structure"]
    rows = [
        ("tokens total", f"{report['tokens_total']}", ""),
        ("tokens unique", f"{report['tokens_unique']}", "computed once each"),
        ("token ratio", f"{report['token_ratio']:.2f}", "total / unique"),
        ("flop ratio", f"{report['flop_ratio']:.2f}",
         f"plain / shared forward+backward FLOPs, {report['model']}"),
        ("planner time", f"{report['planner_ms']:.2f}", "ms"),
        *([("route divergence", f"{report['route_divergent_prefix_tokens']}",
            f"tokens recomputed: routes differ inside token-identical prefixes "
            f"({report['route_divergent_share']:.1%} of what tokens alone would share)")]
          if "route_divergent_prefix_tokens" in report else []),
        *([("vision tokens", f"{report['vision_tokens_computed']}",
            f"computed of {report['vision_tokens_total']} image placeholder tokens"),
           ("images", f"{report['vision_images_computed']}",
            f"distinct (encoded once each) of {report['vision_images_total']}")]
          if "vision_tokens_total" in report else []),
        ("sharing groups", f"{s['sharing_groups']}",
         f"largest: {s['largest_sharing_group']} sequences"),
        ("longest shared prefix", f"{s['longest_shared_prefix']}", "tokens"),
        ("deepest reuse chain", f"{s['deepest_reuse_chain']}",
         "reads in a row (seq a reads b, which reads c, ...)"),
        ("computing nothing", f"{s['sequences_computing_nothing']}",
         "sequences (duplicates, strict prefixes)"),
    ]
    lines = [
        f"{report['file']}: {report['sequences']} sequences; mode {report['mode']}, "
        f"min_prefix_len {report['min_prefix_len']}, min_group_size {report['min_group_size']}",
        "",
        *(f"{label:<22}{value:>10}  {note}".rstrip() for label, value, note in rows),
        "",
    ]
    if "data_parallel" in report:
        lines += [*data_parallel_text(report["data_parallel"]), ""]
    if plan.num_sequences > TREE_LIMIT:
        return lines + [f"prefix tree: not drawn for more than {TREE_LIMIT} sequences"]
    return lines + ["prefix tree (every edge computed once; seq i: where sequence i ends):",
                    *prefix_tree(plan)]
