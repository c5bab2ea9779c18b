"""The ``prefix-sharing`` command.

Each subcommand lives in its own module with an ``add_parser(subparsers)`` that registers it
and sets ``run(args) -> int``. Bad input - an option, a file, a model, a missing package, a setup
prefix sharing refuses (:class:`prefix_sharing.errors.UnsupportedSetup`), also when a spawned
rank finds it - raises :class:`prefix_sharing.errors.InputError` and is printed as one line on
stderr with exit status 2. Anything else is a bug and keeps its traceback (a failed
rank's included); ``--debug`` shows the traceback of input errors too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import InputError
from . import analyze, bench, demo, patchsets, preflight, verify

__all__ = ["main"]

COMMANDS = (demo, analyze, verify, bench, patchsets, preflight)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefix-sharing",
        description="Compute shared token prefixes once in RL training - and check nothing changed.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of every error, bad input included")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    args = parser.parse_args(argv)
    args.argv = [str(arg) for arg in (sys.argv[1:] if argv is None else argv)]  # for --record
    try:
        return args.run(args)
    except InputError as error:
        if args.debug:
            raise
        message = " ".join(str(error).split())  # one line, whatever the message holds
        print(f"prefix-sharing {args.command}: error: {message}", file=sys.stderr)
        return 2
