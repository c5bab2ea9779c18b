"""``prefix-sharing patchsets``: which verl patch sets fit this machine, by the exact name.

Reads the installed verl, megatron-core and MindSpeed releases from package metadata (nothing
is imported) and lists the patch-set names that state that stack, in the prototype's spelling
(:mod:`prefix_sharing.verl_ext.names`): the values for ``PREFIX_SHARING_PATCHSET``. Without the
variable every set for the installed verl release is applied; the listing is for narrowing it,
and for writing into scripts a name that says what it was run on. ``--all`` lists every name
accepted, ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json

from ..verl_ext.names import installed_stack, known_names, matching_names, resolve
from ..verl_ext.patchsets import registered

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patchsets",
        help="list the verl patch sets for the installed stack (PREFIX_SHARING_PATCHSET names)",
        description="List the verl patch-set names that match the installed verl, "
        "megatron-core and MindSpeed: the exact values for PREFIX_SHARING_PATCHSET.",
    )
    parser.add_argument("--all", action="store_true",
                        help="list every accepted name, not only those for this stack")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    known = registered()
    stack = installed_stack()
    listed = known_names(known) if args.all else matching_names(known, stack)
    rows = {name: _applies(name, known) for name in listed}
    if args.json:
        print(json.dumps({
            "installed": {"verl": stack.verl, "megatron_core": stack.megatron_core,
                          "mindspeed": stack.mindspeed,
                          "python": ".".join(map(str, stack.python))},
            "patchsets": rows,
        }, indent=2))
        return 0
    print(f"installed: verl {stack.verl or 'none'}, megatron-core {stack.megatron_core or 'none'}, "
          f"MindSpeed {stack.mindspeed or 'none'}, Python {'.'.join(map(str, stack.python))}")
    if not rows:
        supported = sorted({v for ps in known.values() for v in ps.verl_versions})
        print(f"no patch set for this stack (verl {', '.join(supported)} are supported); "
              "`prefix-sharing patchsets --all` lists every name")
        return 0
    print("every accepted name:" if args.all else
          "patch sets for this stack (PREFIX_SHARING_PATCHSET=<name>[,<name>]; unset, every "
          "set for the installed verl is applied):")
    width = max(map(len, rows))
    for name, applies in rows.items():
        print(f"  {name:<{width}}  applies {' + '.join(applies)}")
    return 0


def _applies(name: str, known: dict) -> list[str]:
    return list(resolve(name, known).patchsets)
