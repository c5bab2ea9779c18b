"""Options several subcommands share: what to share, which model, which micro-batches."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from ..config import MODES, PrefixSharingConfig
from ..planner import PromptGroup
from ..presets import PRESETS, ModelPreset
from ..rollouts import load_rollouts
from ..workloads import WORKLOADS, make_workload
from . import UsageError

__all__ = ["add_sharing_options", "add_model_option", "add_input_options", "sharing_config",
           "Batch", "load_batches"]

Batch = tuple[str, list[torch.Tensor], list[PromptGroup] | None]  # name, sequences, groups


def add_sharing_options(parser: argparse.ArgumentParser) -> None:
    defaults = PrefixSharingConfig()
    parser.add_argument("--mode", default=defaults.mode,
                        help=f"{', '.join(MODES)} (default: %(default)s)")
    parser.add_argument("--min-prefix-len", type=int, default=defaults.min_prefix_len,
                        metavar="N", help="share only prefixes at least this long "
                        "(default: %(default)s)")
    parser.add_argument("--min-group-size", type=int, default=defaults.min_group_size,
                        metavar="N", help="share only prefixes held by at least this many "
                        "sequences (default: %(default)s)")


def sharing_config(args: argparse.Namespace) -> PrefixSharingConfig:
    return PrefixSharingConfig(mode=args.mode, min_prefix_len=args.min_prefix_len,
                               min_group_size=args.min_group_size)


def add_model_option(parser: argparse.ArgumentParser, default: str, purpose: str) -> None:
    parser.add_argument("--model", default=default, metavar="PRESET",
                        help=f"{purpose}: {', '.join(PRESETS)} (default: %(default)s)")


def add_input_options(parser: argparse.ArgumentParser, *, many_workloads: bool) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--sequences", metavar="FILE",
                        help="rollouts (.jsonl or .parquet, as for analyze) as one micro-batch")
    if many_workloads:
        source.add_argument("--workload", metavar="NAME", action="append",
                            help=f"a built-in micro-batch: {', '.join(WORKLOADS)} "
                            "(repeatable; default: all)")
    else:
        source.add_argument("--workload", metavar="NAME", default="grpo",
                            help=f"a built-in micro-batch: {', '.join(WORKLOADS)} "
                            "(default: %(default)s)")


def load_batches(args: argparse.Namespace, model: ModelPreset,
                 sizes: dict[str, dict] | None = None) -> list[Batch]:
    """The micro-batches named by ``--sequences`` / ``--workload``, checked against the model.

    ``sizes``: keyword arguments per built-in workload (their defaults when omitted).
    """
    if args.sequences:
        rollouts = load_rollouts(args.sequences)
        batches = [(args.sequences, rollouts.sequences, rollouts.groups)]
    else:
        names = args.workload or list(WORKLOADS)
        names = [names] if isinstance(names, str) else names
        batches = []
        for name in names:
            w = make_workload(name, vocab_size=model.vocab_size, **(sizes or {}).get(name, {}))
            batches.append((name, w.sequences, w.groups))
    for name, seqs, _ in batches:
        _check_fits(name, seqs, model)
    return batches


def _check_fits(name: str, sequences: Sequence[torch.Tensor], model: ModelPreset) -> None:
    largest = max(int(s.max()) for s in sequences)
    if largest >= model.vocab_size:
        raise UsageError(f"{name}: token id {largest} is outside the {model.name} preset's "
                         f"vocabulary of {model.vocab_size}")
    longest = max(len(s) for s in sequences)
    if longest > model.max_sequence_length:
        raise UsageError(f"{name}: a sequence of {longest} tokens is longer than the "
                         f"{model.name} preset allows ({model.max_sequence_length})")
