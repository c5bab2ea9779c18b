"""``prefix-sharing verify``: the shared forward+backward equals the plain one - measured.

Runs a seeded random-weight model of ``--model``'s shape plain (megatron's stock spec on padded
input) and shared (the prefix-sharing spec on the plan) on the same micro-batch, under the
given tensor / pipeline / context parallel sizes, and reports the largest differences of logits,
log-probs, entropy, loss and gradients. Exit status 0 only when within tolerance.

With ``--token-budget N`` the shared run computes each group (a prompt group of the input, or
the whole micro-batch) in micro-batches of at most N computed tokens, each of its shared
prefixes once across them - a prefix longer than N in chunks, a sub-tree over N with its own
shared blocks (cross-micro-batch sharing; CP=1; tensor parallel, MoE presets with
sequence parallelism, windows and ``--recompute`` too; at ``--pp 2`` and more every block
computed again in its backward step) - and is judged against
the plain run of the same samples in the same micro-batches (one per suffix micro-batch, its samples
whole: the stock step's split, over which MoE router statistics are taken).

With ``--routing-replay`` (MoE presets) every run replays recorded routes (megatron's
``moe_enable_routing_replay``): routes that depend on each token's prefix, as a batch-invariant
rollout engine records them, with one token's route changed inside the longest shared prefix
(rollout engines are not batch-invariant). The plan shares only as far as the routes agree, and
the shared run replays each computed row's route; the plain runs replay them on the padded batch.
With ``--token-budget`` too, each group is cut on tokens and routes across its micro-batches.
"""

from __future__ import annotations

import argparse
import json

from ..engines import get_engine
from ..errors import InputError
from ..engines.recompute import recompute_settings
from ..engines.memory import available_bytes, check_fits, verify_peak_bytes
from ..engines.verify import VerifyRequest, reference_dtype
from ..config import PrefixSharingConfig
from ..cross_micro_batch import plan_group
from ..planner import PromptGroup, build_plan
from ..presets import ModelPreset, get_preset
from ..equivalence import FP32_RTOL, QUANTITIES
from .options import (add_backend_option, add_dtype_option, add_engine_option,
                      add_input_options, add_model_option, add_recompute_option,
                      add_sharing_options, help_text, load_batches, run_dtype,
                      sharing_config, user_input)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="prove the shared forward+backward equals the plain one",
        description=help_text(__doc__))
    add_input_options(parser, many_workloads=False)
    add_engine_option(parser)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel size: the shared run's rows split over this many "
                        "ranks, against the plain run at 1 (default: 1)")
    add_dtype_option(parser)
    parser.add_argument("--steps", type=int, default=1,
                        help="compare at this many points of the plain model's Adam "
                        "trajectory (default: 1)")
    add_model_option(parser, "tiny", "model shape (random weights)")
    add_sharing_options(parser)
    add_backend_option(parser)
    parser.add_argument("--token-budget", type=int, metavar="N",
                        help="run each group in micro-batches of at most N computed tokens, "
                        "each shared prefix computed once across them (one level at pp>1)")
    add_recompute_option(parser)
    parser.add_argument("--routing-replay", action="store_true",
                        help="replay recorded MoE routes (one diverging inside a shared prefix) "
                        "in every run (MoE presets)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    dtype = run_dtype(args)
    if args.steps < 1:
        raise InputError(f"--steps must be at least 1; got {args.steps}")
    engine, config = get_engine(args.engine), sharing_config(args)
    model, ((name, sequences, groups),) = load_batches(args, get_preset(args.model),
                                                       tensor_parallel=args.tp)
    engine.check_installed()
    engine.check_layout(model, args.tp, args.pp, args.cp)
    if config.mode == "prompt_only" and groups is None:
        raise InputError(f"--mode prompt_only needs prompt groups, but {name} has input_ids only")
    routes, diverged_at = None, None
    if args.routing_replay:
        routes, diverged_at = _replay_routes(engine.name, model, sequences, config, groups)
    if args.token_budget is not None:
        _check_cross(args, engine.name, model, sequences, groups, config, routes)
    else:
        groups = groups if config.mode == "prompt_only" else None
    _check_memory(args, model, [len(s) for s in sequences], dtype)
    request = VerifyRequest([(sequences, groups)], config, model, dtype, args.steps,
                            token_budget=args.token_budget,
                            routes=None if routes is None else [routes],
                            model_settings=recompute_settings(args.recompute))
    report, = engine.verify(request, args.tp, args.pp, args.cp)
    plan = build_plan(sequences, config, groups=groups if config.mode == "prompt_only" else None,
                      routes=routes)
    if routes is not None:
        report.update(routing_replay=True, route_diverged_at=diverged_at,
                      route_divergent_prefix_tokens=plan.route_divergent_prefix_tokens)
    report.update(input=name, engine=engine.name, model=model.name, vocab_size=model.vocab_size,
                  tp=args.tp, pp=args.pp, cp=args.cp, dtype=args.dtype, backend=config.backend,
                  steps=args.steps, mode=config.mode, tokens_total=plan.num_tokens_total,
                  token_budget=args.token_budget, recompute=args.recompute,
                  tokens_unique=plan.num_tokens_unique, sequences=plan.num_sequences)
    print(json.dumps(report) if args.json else _text(report))
    return 0 if report["passed"] else 1


def _check_cross(args: argparse.Namespace, engine: str, model: ModelPreset,
                 sequences: list, groups: list[PromptGroup] | None,
                 config: PrefixSharingConfig, routes: list | None = None) -> None:
    """What ``--token-budget`` cannot run, as one line before any rank starts."""
    if engine != "megatron" or args.pp > 1 and args.cp > 1:
        raise InputError("--token-budget (cross-micro-batch sharing) runs on the megatron "
                         "engine, under --pp or --cp but not both; got --engine "
                         f"{engine} --pp {args.pp} --cp {args.cp}")
    members = [list(range(len(sequences)))] if groups is None else [g.members for g in groups]
    for m in members:
        with user_input(ValueError):
            plan_group([sequences[i] for i in m], args.token_budget, config,
                 pad_to_multiple_of=args.tp,
                 routes=None if routes is None else [routes[i] for i in m])


def _check_memory(args: argparse.Namespace, model: ModelPreset, lengths: list[int],
                  dtype) -> None:
    """Refuses, before any rank starts, a run whose estimated peak memory the machine does not
    have (:mod:`prefix_sharing.engines.memory`), saying how many of the file's first rows fit."""
    ranks, available = args.tp * args.pp * args.cp, available_bytes()

    def peak(rows: list[int]) -> int:
        return verify_peak_bytes(model, rows, dtype.itemsize, reference_dtype(dtype).itemsize,
                                 ranks, args.tp)

    what = (f"{len(lengths)} sequences padded to {max(lengths)} tokens in the plain runs, the "
            f"{model.name} preset with a {model.vocab_size}-token vocabulary, {args.dtype} with a "
            f"{str(reference_dtype(dtype)).removeprefix('torch.')} reference")
    if args.sequences:
        fit = max((k for k in range(1, len(lengths)) if peak(lengths[:k]) <= available),
                  default=0)
        instead = (f"pass fewer rows (its first {fit} fit), shorter ones, or smaller token ids "
                   "(the vocabulary is sized to the largest)" if fit else
                   "pass shorter rows or smaller token ids (the vocabulary is sized to the "
                   "largest)")
    else:
        instead = "pass --model tiny"
    check_fits("verify", peak(lengths), what, instead, available)


def _replay_routes(engine: str, model: ModelPreset, sequences: list,
                   config: PrefixSharingConfig,
                   groups: list[PromptGroup] | None) -> tuple[list, list[int] | None]:
    """The routes ``--routing-replay`` replays, and where one was made to diverge (None when
    nothing is shared, so nothing can diverge inside a shared prefix; with ``--token-budget``,
    inside a prompt group's common prefix, which its schedule must then cut shorter)."""
    from ..routes import diverge_inside_shared_prefix, recorded_routes

    if engine != "megatron" or not model.num_experts:
        raise InputError(f"--routing-replay replays MoE routes on the megatron engine; got "
                         f"--engine {engine} with the {model.name} preset "
                         f"({model.num_experts or 'no'} experts)")
    groups = groups if config.mode == "prompt_only" else None
    routes = recorded_routes(sequences, model.num_layers, model.moe_router_topk,
                             model.num_experts)
    if not build_plan(sequences, config, groups=groups).has_sharing:
        return routes, None
    routes, where = diverge_inside_shared_prefix(sequences, routes, model.num_experts, config,
                                                 groups)
    return routes, list(where)


def _text(r: dict) -> str:
    lines = [
        f"verify {r['input']}: {r['sequences']} sequences, {r['tokens_total']} tokens, "
        f"{r['tokens_unique']} computed ({r['mode']}); {r['engine']} engine, {r['model']} model "
        f"(vocabulary {r['vocab_size']}), {r['dtype']}, {r['backend']} attention, "
        f"tp={r['tp']} pp={r['pp']} cp={r['cp']}, {r['steps']} step(s)"
        + (f", {r['recompute']} activation recompute" if r.get("recompute") else ""),
        "",
        f"differences from the plain run in {r['reference_dtype']} (relative to each quantity's "
        "scale; allowed: 2x, grads 3x, the plain run's own, plus a floor)",
        f"{'quantity':<10} {'shared':>9} {'plain':>9} {'allowed':>9} {'vs plain':>9}  result",
    ]
    for q in QUANTITIES:
        ok = "ok" if r["within_tolerance"][q] else "FAILED"
        figures = (r[key][q] for key in ("max_rel_diff", "plain_max_rel_diff", "allowed_rel_diff",
                                         "vs_plain_max_rel_diff"))
        lines.append(f"{q:<10} " + " ".join(f"{x:>9.2e}" for x in figures) + f"  {ok}")
    lines += ["", f"vs plain: the shared run against the plain {r['dtype']} run"
              + (f" (within {FP32_RTOL:.0e}: {'yes' if r['vs_plain_within_fp32_rtol'] else 'no'})"
                 if r["dtype"] == "float32" else ""), ""]
    if r.get("routing_replay"):
        where = r["route_diverged_at"]
        lines.append("routing replay: recorded routes replayed in every run; "
                     + (f"sequence {where[0]}'s route changed at token {where[1]}, inside a shared "
                        f"prefix: {r['route_divergent_prefix_tokens']} more tokens computed"
                        if where else "nothing shared, so no route diverges"))
    if not r["same_plan_on_every_rank"]:
        lines.append("FAILED: the ranks built different plans")
    if r["token_budget"] is not None:
        lines.append(f"across micro-batches of <= {r['token_budget']} tokens: "
                     f"{r['num_micro_batches']} micro-batches, {r['tokens_computed']} tokens "
                     f"computed ({r['tokens_unique']} unique in the whole batch), "
                     f"{r['held_bytes']} bytes of prefix K/V (and MoE router logits) held; judged against the plain run "
                     "of the same samples in the same micro-batches")
    lines.append("PASSED: shared == plain within tolerance" if r["passed"] else "FAILED")
    return "\n".join(lines)
