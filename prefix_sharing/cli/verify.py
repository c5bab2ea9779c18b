"""``prefix-sharing verify``: the shared forward+backward equals the plain one - measured.

Runs a seeded random-weight model of ``--model``'s shape plain (megatron's stock spec on padded
input) and shared (the prefix-sharing spec on the plan) on the same micro-batch, under the
given tensor / pipeline parallel sizes, and reports the largest differences of logits,
log-probs, entropy, loss and gradients. Exit status 0 only when within tolerance.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..engines import ENGINES, get_engine
from ..engines.verify import VerifyRequest
from ..planner import build_plan
from ..presets import get_preset
from ..equivalence import FP32_RTOL, QUANTITIES
from .options import (add_input_options, add_model_option, add_sharing_options, load_batches,
                      sharing_config)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="prove the shared forward+backward equals the plain one",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    add_input_options(parser, many_workloads=False)
    parser.add_argument("--engine", default="megatron", help=f"{', '.join(ENGINES)} (default: %(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    parser.add_argument("--steps", type=int, default=1,
                        help="compare at this many points of the plain model's Adam "
                        "trajectory (default: 1)")
    add_model_option(parser, "tiny", "model shape (random weights)")
    add_sharing_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {args.dtype!r}")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1; got {args.steps}")
    engine, model, config = get_engine(args.engine), get_preset(args.model), sharing_config(args)
    engine.check_installed()
    engine.check_layout(model, args.tp, args.pp)
    (name, sequences, groups), = load_batches(args, model)
    if config.mode == "prompt_only" and groups is None:
        raise ValueError(f"--mode prompt_only needs prompt groups, but {name} has input_ids only")
    groups = groups if config.mode == "prompt_only" else None
    request = VerifyRequest([(sequences, groups)], config, model, DTYPES[args.dtype], args.steps)
    report, = engine.verify(request, args.tp, args.pp)
    plan = build_plan(sequences, config, groups=groups)
    report.update(input=name, engine=engine.name, model=model.name, tp=args.tp, pp=args.pp,
                  dtype=args.dtype, steps=args.steps, mode=config.mode,
                  tokens_total=plan.num_tokens_total, tokens_unique=plan.num_tokens_unique,
                  sequences=plan.num_sequences)
    print(json.dumps(report) if args.json else _text(report))
    return 0 if report["passed"] else 1


def _text(r: dict) -> str:
    lines = [
        f"verify {r['input']}: {r['sequences']} sequences, {r['tokens_total']} tokens, "
        f"{r['tokens_unique']} computed ({r['mode']}); {r['engine']} engine, {r['model']} model, "
        f"{r['dtype']}, tp={r['tp']} pp={r['pp']}, {r['steps']} step(s)",
        "",
        f"{'quantity':<10} {'max abs diff':>13} {'max rel diff':>13} {'allowed':>10}  result",
    ]
    for q in QUANTITIES:
        plain = r["plain_max_rel_diff"]
        factor = 3 if q == "grads" else 2
        allowed = f"{FP32_RTOL:.0e}" if plain is None else f"{factor}x{plain[q]:.1e}"
        ok = "ok" if r["within_tolerance"][q] else "FAILED"
        lines.append(f"{q:<10} {r['max_abs_diff'][q]:>13.2e} {r['max_rel_diff'][q]:>13.2e} "
                     f"{allowed:>10}  {ok}")
    lines.append("")
    if not r["same_plan_on_every_rank"]:
        lines.append("FAILED: the ranks built different plans")
    lines.append("PASSED: shared == plain within tolerance" if r["passed"] else "FAILED")
    return "\n".join(lines)
