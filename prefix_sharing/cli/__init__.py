"""The ``prefix-sharing`` command.

Each subcommand lives in its own module with an ``add_parser(subparsers)`` that registers it
and sets ``run(args) -> int``. Errors a user can fix (a missing file or package, a bad file or
option) are printed as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "UsageError"]


class UsageError(Exception):
    """A problem with the user's input or setup, reported as one line."""


# Imported after UsageError, which the subcommands raise.
from . import analyze, bench, demo, verify  # noqa: E402

COMMANDS = (demo, analyze, verify, bench)


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
    except (UsageError, ValueError, OSError, ImportError) as error:
        message = " ".join(str(error).split())  # one line, whatever the message holds
        print(f"prefix-sharing {args.command}: error: {message}", file=sys.stderr)
        return 2
