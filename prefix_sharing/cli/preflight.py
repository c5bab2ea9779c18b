"""``prefix-sharing preflight``: does sharing apply to each role of a verl launch?

Before a GPU is allocated: from a launch's hydra overrides (``-- key=value ...``), a launch
script (``--script run.sh``: its ``python -m verl.trainer...`` arguments, bash variables
resolved, :mod:`prefix_sharing.verl_ext.launch_script`) or a resolved config file
(``--config FILE.yaml``), it composes verl's trainer config and asks each role's sharing engine
what it would refuse at construction (:mod:`prefix_sharing.verl_ext.preflight`: the same
function the engine's constructor raises from). Prints per role whether sharing applies and,
for each refusal, its key, the setting found and the reason with the change to make. Exit 0
when every role that asks for sharing gets it, 1 when one is refused, 2 for bad input. Needs
verl (and hydra, which verl installs); builds no model and touches no device.
"""

from __future__ import annotations

import argparse
import json

from ..errors import InputError, MissingPackageError
from .options import user_input

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="say, before a GPU is allocated, whether sharing applies to each role of a verl "
             "launch (and why not)",
        description="Compose a verl launch's config (hydra overrides after --, a launch "
        "script, or a resolved config file) and report per role (actor, reference, critic, "
        "SFT model) whether prefix sharing applies, through the checks the engines run at "
        "construction. Exit 0: every role that asks for sharing gets it; 1: one is refused; "
        "2: bad input.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--script", metavar="RUN.sh",
                        help="a launch script: its python -m verl.trainer... arguments are read "
                             "(arguments after -- stand for the script's \"$@\")")
    source.add_argument("--config", metavar="FILE.yaml",
                        help="a resolved trainer config (merged over verl's defaults)")
    parser.add_argument("--config-name", default=None,
                        help="verl's trainer config to compose (default: ppo_trainer, or the "
                             "script's --config-name)")
    parser.add_argument("--model-config", metavar="DIR", default=None,
                        help="a directory with the model's config.json, for a model.path that "
                             "cannot be read here (a hub name)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="hydra overrides (after --)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from ..verl_ext import preflight as checks
        from ..verl_ext.launch_script import read_launch_script
        import hydra  # noqa: F401
    except ImportError as error:
        raise MissingPackageError(f"preflight needs verl installed ({error}); run it in the "
                                  "environment the launch uses") from error
    unresolved: list[str] = []
    with user_input(ValueError, OSError, KeyError, TypeError):
        if args.config is not None:
            config = checks.load_config(args.config)
            source = args.config
        else:
            overrides, name = list(args.overrides), args.config_name
            if args.script is not None:
                launch = read_launch_script(args.script, args.overrides)
                overrides, name = launch.overrides, name or launch.config_name
                unresolved = launch.unresolved
                source = f"{args.script} ({launch.module})"
            else:
                source = "the command line"
            name = name or "ppo_trainer"
            config = _compose(checks, overrides, name)
            source = f"{source}: verl's {name} + {len(overrides)} override(s)"
        result = _verl_input(checks.preflight, config, args.model_config)
    if args.json:
        print(json.dumps(_as_json(result, source, unresolved), indent=2))
    else:
        _print(result, source, unresolved)
    return 1 if result.refused else 0


def _compose(checks, overrides: list[str], name: str):
    return _verl_input(checks.compose_config, overrides, name)


def _verl_input(function, *args):
    """``function(*args)``, hydra's and OmegaConf's errors (an override, a config name or a
    config verl's own validation rejects) turned into bad input."""
    try:
        return function(*args)
    except Exception as error:
        if type(error).__module__.split(".")[0] in ("hydra", "omegaconf"):
            raise InputError(f"verl rejects the config: {error}") from error
        raise


def _print(result, source: str, unresolved: list[str]) -> None:
    print(f"launch: {source}")
    if unresolved:
        print(f"left as written (not assigned in the script): {', '.join(unresolved)}")
    print(f"model: {result.model_note}")
    width = max(len(role.role) for role in result.roles)
    for role in result.roles:
        if role.asked:
            verdict = "shares" if role.served else "REFUSED"
        else:
            verdict = ("does not ask for sharing; it would " +
                       ("apply" if role.served else "be refused"))
        print(f"  {role.role:<{width}}  {role.engine:<8}  {verdict}"
              + (f"  ({role.note})" if role.note else ""))
        for problem in role.problems:
            entry = problem.entry
            detail = f" ({problem.detail})" if problem.detail else ""
            print(f"      [{problem.key}] {entry.setting}{detail}: {entry.reason}")
    if not any(role.asked for role in result.roles):
        print("no role asks for sharing: set actor_rollout_ref.actor.use_prefix_grouper=true")


def _as_json(result, source: str, unresolved: list[str]) -> dict:
    return {
        "launch": source, "unresolved": unresolved, "model": result.model_note,
        "refused": result.refused,
        "roles": [{"role": role.role, "engine": role.engine, "asked": role.asked,
                   "served": role.served, "note": role.note,
                   "refusals": [{"key": p.key, "setting": p.entry.setting, "found": p.detail,
                                 "reason": p.entry.reason} for p in role.problems]}
                  for role in result.roles],
    }
