"""``prefix-sharing bench``: time and memory of a training step, plain vs shared.

For each micro-batch: the plain packed step and the shared step (plus ``prompt_only`` where the
batch has prompt groups), timed interleaved in one process, medians; the FLOP ratio of the plan
is the physical limit of the speedup. ``--plot`` draws speedup against FLOP ratio.
``--cp N`` (with ``--tp``, ``--pp``) times plain CP against shared CP on that many ranks and
counts the K/V bytes each attention layer's collectives move. ``--record FILE.json`` saves the
run as a result file of the benchmarks page (:mod:`prefix_sharing.cli.record`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from ..engines import get_engine
from ..engines.bench import BenchRequest, BenchWorkload
from ..engines.bench_cp import table as cp_table
from ..engines.memory import bench_peak_bytes, check_fits
from ..engines.throughput import throughput_report
from ..presets import get_preset
from ..workloads import scale_lengths
from ..errors import InputError, MissingPackageError
from .record import write_result
from .options import (add_backend_option, add_dtype_option, add_engine_option,
                      add_input_options, add_model_option, add_recompute_option,
                      add_sharing_options, help_text, load_batches, run_dtype, sharing_config,
                      user_input)

# Built-in micro-batch sizes for the bench: ~1-2k tokens, so that on the "small" preset a CPU
# step takes about a second and matrix products dominate it, as they do on real models.
BENCH_SIZES = {
    "grpo": dict(num_prompts=2, group_size=4, prompt_len=(160, 200), response_len=(48, 96)),
    "steprl": dict(num_chains=2, num_steps=4, prompt_len=(96, 128), step_len=(32, 64)),
    "tree": dict(depth=3, branching=2, prompt_len=(96, 128), node_len=(24, 48)),
    "agent": dict(num_tasks=2, num_turns=3, branching=2, system_len=96, task_len=(16, 32),
                  turn_len=(16, 32)),
    "none": dict(num_sequences=8, seq_len=(160, 224)),
    # issue 31's long history (32k tokens, 8 branches of 2k) at --length-scale 64
    "history": dict(history_len=512, branches=8, branch_len=32),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="time a training step plain vs shared, and its peak memory",
        description=help_text(__doc__))
    add_input_options(parser, many_workloads=True)
    add_engine_option(parser)
    add_model_option(parser, "small", "model shape (random weights)")
    add_dtype_option(parser)
    add_sharing_options(parser)
    add_backend_option(parser)
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel size: time plain CP against shared CP on "
                        "tp x pp x cp ranks and count the K/V bytes per attention layer "
                        "(default: 1, the one-rank step bench)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size, with --cp (default: 1)")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel size, with --cp (default: 1)")
    parser.add_argument("--length-scale", type=int, default=1, metavar="K",
                        help="built-in workloads: every segment K times as long (same sharing "
                        "shape, K times the tokens), so that a small preset's products, not "
                        "its per-operator cost, dominate the step (default: 1)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed steps per mode, after one warm-up (default: 5)")
    add_recompute_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw speedup against FLOP ratio")
    parser.add_argument("--record", metavar="FILE.json",
                        help="also save the run as a result file (docs/results/NAME.json: the "
                        "command, date, machine, versions, the table and the JSON report)")
    parser.add_argument("--token-budget", type=int, metavar="N",
                        help="throughput view: sequences/s when each micro-batch holds N tokens "
                             "(plain: all its tokens; shared: the tokens it computes)")
    parser.add_argument("--cross-micro-batch", action="store_true",
                        help="with --token-budget: also time each group across micro-batches "
                             "of N computed tokens, its prefix computed once (tp=pp=1)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise InputError(f"--repeats must be at least 1; got {args.repeats}")
    dtype = run_dtype(args)
    engine, config = get_engine(args.engine), sharing_config(args)
    if config.mode != "arbitrary_prefix":
        raise InputError("bench compares arbitrary_prefix sharing (and prompt_only where the "
                         f"batch has prompt groups) with the plain step; got --mode {config.mode}")
    if args.plot:
        _check_plotting()
    if args.record and not Path(args.record).parent.is_dir():
        raise InputError(f"--record {args.record}: its folder does not exist")
    if args.length_scale != 1 and args.sequences:
        raise InputError("--length-scale scales the built-in workloads; leave it out with "
                         "--sequences")
    with user_input(ValueError):
        sizes = {name: scale_lengths(kwargs, args.length_scale)
                 for name, kwargs in BENCH_SIZES.items()}
    model, batches = load_batches(args, get_preset(args.model), sizes)
    workloads = [BenchWorkload(name, seqs, groups) for name, seqs, groups in batches]
    _check_memory(args, model, batches, dtype)
    if args.cross_micro_batch and args.token_budget is None:
        raise InputError("--cross-micro-batch needs --token-budget N")
    if args.recompute is not None and (args.token_budget is None
                                       or (args.tp, args.pp, args.cp) != (1, 1, 1)):
        raise InputError("--recompute runs in the throughput view (--token-budget N, tp = pp = "
                         "cp = 1); the step and context-parallel benches run without it")
    if (args.tp, args.pp, args.cp) != (1, 1, 1):
        return _bench_context_parallel(args, engine, model, config, workloads, dtype)
    if args.token_budget is not None:
        report, text = throughput_report(args, engine, model, config, workloads, dtype)
        return _emit(args, report, text, f"Throughput at {args.token_budget} tokens per "
                     f"micro-batch, {engine.name} engine, {model.name} preset")
    results = engine.bench(BenchRequest(workloads, config, model, repeats=args.repeats,
                                        dtype=dtype))
    report = {"engine": engine.name, "model": model.name, "vocab_size": model.vocab_size,
              "length_scale": args.length_scale,
              "dtype": args.dtype, "backend": config.backend, "repeats": args.repeats,
              "results": results}
    if args.plot:
        plot(results, args.plot, title=f"{engine.name} engine, {model.name} model")
        report["plot"] = args.plot
    return _emit(args, report, table(results),
                 f"Training step, {engine.name} engine, {model.name} preset")


def _check_memory(args: argparse.Namespace, model, batches, dtype) -> None:
    """Refuses, before any step runs, micro-batches whose estimated peak memory the machine
    does not have (:mod:`prefix_sharing.engines.memory`)."""
    lengths = [[len(s) for s in seqs] for _, seqs, _ in batches]
    largest = max(lengths, key=sum)
    what = (f"the largest micro-batch {min(sum(largest), args.token_budget or sum(largest))} "
            f"tokens, the {model.name} preset with a "
            f"{model.vocab_size}-token vocabulary, {args.dtype}")
    instead = ("pass fewer or shorter rows, or smaller token ids (the vocabulary is sized to the "
               "largest)" if args.sequences else
               "pass a smaller --length-scale, --model tiny, or fewer --workload names")
    estimate = bench_peak_bytes(model, lengths, dtype.itemsize, args.tp * args.pp * args.cp,
                                args.tp, args.token_budget)
    check_fits("bench", estimate, what, instead)


def _emit(args: argparse.Namespace, report: dict, text: str, title: str) -> int:
    """Prints the report (``--json``) or its table, and with ``--record`` writes both, with
    the run's provenance, as a result file."""
    print(json.dumps(report) if args.json else text)
    if args.record:
        write_result(args.record, args.argv, title, report, text)
    return 0


def _bench_context_parallel(args: argparse.Namespace, engine, model, config, workloads,
                            dtype) -> int:
    """``bench --cp N [--tp N] [--pp N]``: plain CP vs shared CP (``--json``: one object)."""
    if engine.name != "megatron":
        raise InputError(f"--cp runs on the megatron engine; got --engine {engine.name}")
    engine.check_layout(model, args.tp, args.pp, args.cp)
    if args.cp < 2:
        raise InputError(f"--tp {args.tp} --pp {args.pp} run in the context-parallel bench; "
                         f"add --cp 2 or more (got --cp {args.cp})")
    others = [flag for flag, on in (("--token-budget", args.token_budget is not None),
                                    ("--plot", bool(args.plot)),
                                    ("--cross-micro-batch", args.cross_micro_batch)) if on]
    if others:
        raise InputError(f"--cp times one step per workload; leave out {', '.join(others)}")
    request = BenchRequest(workloads, config, model, repeats=args.repeats, dtype=dtype)
    results = engine.bench_context_parallel(request, args.tp, args.pp, args.cp)
    report = {"engine": engine.name, "model": model.name, "dtype": args.dtype,
              "length_scale": args.length_scale,
              "backend": config.backend, "tp": args.tp, "pp": args.pp, "cp": args.cp,
              "repeats": args.repeats, "results": results}
    return _emit(args, report, cp_table(results), f"Context-parallel step, tp {args.tp} x pp "
                 f"{args.pp} x cp {args.cp}, {model.name} preset")


PEER_LABELS = {"prefix_grouper": "PG (peer)"}


def table(results: list[dict]) -> str:
    """The bench's table. Results that carry a noise figure (every run since it was added) get
    its column and ``~`` on a speedup within it; older result files print as they were."""
    noisy = any("noise" in r for r in results)
    noise_head, speedup_width = (f" {'noise':>6}", 9) if noisy else ("", 8)
    no_noise = f" {'-':>6}" if noisy else ""  # a peer's row: its steps are not compared
    header = (f"{'workload':<10} {'mode':<12} {'tokens':>7} {'unique':>7} {'flop x':>7} "
              f"{'plain ms':>9} {'shared ms':>9} {'speedup':>{speedup_width}}{noise_head} "
              f"{'of flop':>8} {'memory x':>9} {'plan ms':>8}")
    lines = [header]
    for r in results:
        for mode, entry in (("arbitrary", r), ("prompt_only", r.get("prompt_only"))):
            if entry is None:
                continue
            noise = f" {entry['noise']:>6.0%}" if noisy else ""
            speedup = ("~" if entry.get("within_noise") else "") + f"{entry['speedup']:.2f}"
            lines.append(
                f"{r['workload']:<10} {mode:<12} {entry['tokens_total']:>7} "
                f"{entry['tokens_unique']:>7} {entry['flop_ratio']:>7.2f} {r['plain_ms']:>9.0f} "
                f"{entry['shared_ms']:>9.0f} {speedup:>{speedup_width}}{noise} "
                f"{entry['speedup_vs_flop_ratio']:>8.2f} {entry['memory_ratio']:>9.2f} "
                f"{entry['planner_ms']:>8.2f}")
        for name, peer in r.get("peers", {}).items():  # another implementation, same model
            lines.append(
                f"{r['workload']:<10} {PEER_LABELS.get(name, name):<12} {r['tokens_total']:>7} "
                f"{peer['tokens_computed']:>7} {'-':>7} {r['plain_ms']:>9.0f} {peer['ms']:>9.0f} "
                f"{peer['speedup']:>{speedup_width}.2f}{no_noise} "
                f"{'-':>8} {peer['memory_ratio']:>9.2f} {'-':>8}")
    for r in results:
        if "vision" in r:
            v = r["vision"]
            lines.append(f"{r['workload']:<10} vision: {v['vision_images_computed']} of "
                         f"{v['vision_images_total']} images encoded, "
                         f"{v['vision_tokens_computed']} of {v['vision_tokens_total']} vision "
                         "tokens computed (plain: every image of every sequence)")
    lines += ["", "flop x: plain/shared FLOPs (the limit); speedup: plain/shared step time "
              "(median); of flop: speedup/flop x; memory x: plain/shared peak memory"]
    kv = [f"{r['workload']} {r['kv_rows_per_layer']} ({r['kv_execution']}) / "
          f"{r['kv_rows_gather']}" for r in results if "kv_rows_per_layer" in r]
    if kv:  # results recorded before issue 39 have no such count
        lines.append("K/V rows one attention layer holds, shared step (its execution) / with "
                     "every segment's keys gathered; the plain step holds its tokens: "
                     + ", ".join(kv))
    if noisy:
        lines.append("noise: the spread of the timed steps, (slowest - fastest) / median, of the "
                     "noisier mode; ~: the speedup is within that noise of 1 (no difference "
                     "measured: more --repeats, a larger --length-scale or a quieter machine)")
    if any("peers" in r for r in results):
        lines.append("PG (peer): PrefixGrouper's step on the same model and weights; its unique "
                     "tokens are its padded grid (groups x longest group)")
    return "\n".join(lines)


def _check_plotting() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingPackageError("--plot needs matplotlib (pip install 'prefix-sharing[bench]')")


def plot(results: list[dict], path: str, title: str) -> None:
    """Speedup against FLOP ratio, one point per workload and mode, with the y = x limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    points = [(r["workload"], r) for r in results]
    points += [(f"{r['workload']} (prompt only)", r["prompt_only"]) for r in results
               if "prompt_only" in r]
    limit = max(max(e["flop_ratio"], e["speedup"]) for _, e in points) * 1.1
    ax.plot([1, limit], [1, limit], "--", color="gray", label="speedup = FLOP ratio")
    for label, e in points:
        ax.scatter(e["flop_ratio"], e["speedup"], s=40)
        ax.annotate(label, (e["flop_ratio"], e["speedup"]), textcoords="offset points",
                    xytext=(5, -10), fontsize=8)
    ax.set(xlabel="FLOP ratio (plain / shared)", ylabel="speedup (plain / shared time)",
           title=title, xlim=(0.9, limit), ylim=(0.9, limit))
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
