"""The ``prefix-sharing`` command.

Each subcommand lives in its own module with an ``add_parser(subparsers)`` that registers it
and sets ``run(args) -> int``. Errors a user can fix (a missing file, a bad option) are printed
as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import demo

__all__ = ["main", "UsageError"]

COMMANDS = (demo,)


class UsageError(Exception):
    """A problem with the user's input or setup, reported as one line."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prefix-sharing",
        description="Compute shared token prefixes once in RL training - and check nothing changed.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, ValueError, FileNotFoundError) as error:
        print(f"prefix-sharing {args.command}: error: {error}", file=sys.stderr)
        return 2
