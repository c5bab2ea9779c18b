"""Options several subcommands share: what to share, which model, which micro-batches."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator, Sequence

import torch

from ..config import BACKENDS, MODES, PrefixSharingConfig
from ..engines.recompute import RECOMPUTE
from ..planner import PromptGroup
from ..presets import PRESETS, ModelPreset
from ..rollouts import Rollouts, RolloutError, load_rollouts
from ..workloads import LONG_WORKLOADS, WORKLOADS, make_workload
from ..errors import InputError, MissingPackageError
from ..refusals import refuse

__all__ = ["add_sharing_options", "add_backend_option", "add_dtype_option", "run_dtype",
           "DTYPES", "add_engine_option", "add_model_option", "add_input_options", "sharing_config",
           "Batch", "load_batches", "read_rollouts", "user_input", "add_recompute_option",
           "help_text"]

Batch = tuple[str, list[torch.Tensor], list[PromptGroup] | None]  # name, sequences, groups


# reStructuredText a docstring may hold: a role (:mod:`x`, :func:`~a.b`) or a literal (``x``)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def help_text(doc: str) -> str:
    """A module docstring's second paragraph (the first after its title line) as ``--help``
    shows it: one line of plain text, since argparse prints a description as written - a
    role becomes its target (``~a.b.c``: ``c``), a literal its content."""
    paragraph = " ".join(doc.split("\n\n")[1].split())
    paragraph = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2),
                          paragraph)
    return _LITERAL.sub(r"\1", paragraph)


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32",
                        help=f"parameter and activation dtype: {', '.join(DTYPES)} "
                        "(default: %(default)s)")


def run_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}; got {args.dtype!r}")
    return DTYPES[args.dtype]


def add_backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=PrefixSharingConfig().backend,
                        help=f"attention kernel: {', '.join(BACKENDS)}; auto picks by device and "
                        "dtype (default: %(default)s)")


def add_recompute_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recompute", choices=sorted(RECOMPUTE),
                        help="megatron's activation recompute on every model of the run: full "
                        "(each layer, uniform) or selective (core attention); default: none")


def sharing_config(args: argparse.Namespace) -> PrefixSharingConfig:
    """The config the sharing options (and ``--backend``, where the command has it) give."""
    with user_input(ValueError):
        return PrefixSharingConfig(mode=args.mode, min_prefix_len=args.min_prefix_len,
                                   min_group_size=args.min_group_size,
                                   backend=getattr(args, "backend", PrefixSharingConfig().backend))


@contextlib.contextmanager
def user_input(*errors: type[Exception]) -> Iterator[None]:
    """Turns ``errors`` raised while the user's input is parsed into :class:`InputError`.

    The library raises ``ValueError`` for bad arguments wherever they come from; only the
    command knows that these came straight from the user's options or file, so it re-raises
    them here, and any other ``ValueError`` stays a bug with its traceback.
    """
    try:
        yield
    except InputError:
        raise
    except errors as error:
        raise InputError(str(error)) from error


def read_rollouts(path: str, image_token_id: int | None = None) -> Rollouts:
    """:func:`load_rollouts`, with its errors (a missing or bad file, no pyarrow for Parquet)
    as input errors."""
    try:
        with user_input(RolloutError, OSError):
            return load_rollouts(path, image_token_id)
    except ImportError as error:  # load_rollouts' one ImportError: Parquet without pyarrow
        raise MissingPackageError(str(error)) from error


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    from ..engines import ENGINES

    parser.add_argument("--engine", default="megatron",
                        help=f"{', '.join(ENGINES)} (default: %(default)s)")


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
                            f"(repeatable; default: all), or {', '.join(LONG_WORKLOADS)} "
                            "(one group over the budget: with --token-budget)")
    else:
        source.add_argument("--workload", metavar="NAME", default="grpo",
                            help=f"a built-in micro-batch: {', '.join(WORKLOADS)}, or "
                            f"{', '.join(LONG_WORKLOADS)} (one group: a long history and its "
                            "branches) (default: %(default)s)")


def load_batches(args: argparse.Namespace, model: ModelPreset,
                 sizes: dict[str, dict] | None = None,
                 tensor_parallel: int = 1) -> tuple[ModelPreset, list[Batch]]:
    """The micro-batches named by ``--sequences`` / ``--workload``, and the model to run them.

    The model is ``model`` with its vocabulary grown to hold the file's token ids when it is a
    random-weight shape (:meth:`ModelPreset.fitted_to`); a preset with a real vocabulary
    refuses ids beyond it. ``sizes``: keyword arguments per built-in workload (their defaults
    when omitted).
    """
    if args.sequences:
        if model.image_grid is not None:
            raise refuse("cli.vlm_preset_sequences", f"--model {model.name} --sequences "
                         f"{args.sequences}")
        rollouts = read_rollouts(args.sequences)
        batches = [(args.sequences, rollouts.sequences, rollouts.groups)]
        largest = max(int(s.max()) for s in rollouts.sequences)
        model = model.fitted_to(largest, tensor_parallel)
    else:
        names = args.workload or list(WORKLOADS)
        names = [names] if isinstance(names, str) else names
        batches = []
        for name in names:
            with user_input(ValueError):  # an unknown name
                w = make_workload(name, vocab_size=model.text_vocab_size, **(sizes or {}).get(name, {}))
            batches.append((name, w.sequences, w.groups))
    for name, seqs, _ in batches:
        _check_fits(name, seqs, model)
    return model, batches


def _check_fits(name: str, sequences: Sequence[torch.Tensor], model: ModelPreset) -> None:
    largest = max(int(s.max()) for s in sequences)
    if largest >= model.vocab_size:
        raise InputError(f"{name}: token id {largest} is outside the {model.name} preset's "
                         f"vocabulary of {model.vocab_size} (a real model's: use a preset "
                         "without one, e.g. tiny or small, to size it to the data)")
    longest = max(len(s) for s in sequences)
    if longest > model.max_sequence_length:
        raise InputError(f"{name}: a sequence of {longest} tokens is longer than the "
                         f"{model.name} preset allows ({model.max_sequence_length})")
