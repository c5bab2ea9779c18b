"""``bench --token-budget``: sequences per second when every micro-batch has the same token budget.

A trainer with dynamic batch size fills each micro-batch up to a token budget (verl's
``max_token_len_per_gpu``); its step time follows the number and size of those micro-batches.
Plain, the budget counts every token; shared, it counts the tokens the plan computes, so one
micro-batch carries more sequences (:func:`~prefix_sharing.batching.split_micro_batches` keeps
sharing groups together). Both splits of a workload are timed as whole batches - every
micro-batch's step in turn - interleaved (plain, shared, plain, ...) after a warm-up; medians.
This is the figure that small shared micro-batches, too short to keep a GPU busy, no longer
pull down: under the same budget shared and plain micro-batches do the same amount of work.

With ``cross_micro_batch`` (``bench --token-budget N --cross-micro-batch``) a third mode,
``cross``, runs each group (a prompt group of the workload, or the whole workload) as its
common prefix once plus suffix micro-batches of at most N computed tokens
(:mod:`~prefix_sharing.engines.cross_micro_batch`), where ``shared`` cuts a group larger than
the budget and recomputes its prefix in every piece; and a reference mode, ``whole``, runs each
workload as one shared micro-batch, the budget ignored. The cross view also reports per mode
the tokens and FLOPs computed (:func:`~prefix_sharing.flops.count_flops` over the plans each
micro-batch runs), the peak memory of the whole batch's step
(:func:`~prefix_sharing.engines.bench.peak_memory_bytes`, a separate untimed run), the most
K/V rows one attention layer holds in any of its micro-batches
(:func:`~prefix_sharing.attention.sources.key_rows`; ``cross``'s stored blocks, read in place,
counted apart: they are the K/V bytes held across micro-batches) and what the gather would
hold; each against ``whole``. Its sequences may
exceed the budget: the ordinary split then runs each alone (``oversized``), its history
recomputed in every piece.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import torch

from ..attention.backends import resolve_backend
from ..attention.sources import key_rows
from ..batching import MicroBatchSplit, split_micro_batches
from ..config import PrefixSharingConfig
from ..cross_micro_batch import plan_group
from ..errors import InputError
from ..flops import count_flops
from ..planner import build_plan
from ..presets import ModelPreset
from .bench import (BenchWorkload, Progress, keep_freed_memory_in_heap, megatron_training_step,
                    peak_memory_bytes, timed)
from .launch import run_distributed
from .recompute import recompute_settings

__all__ = ["ThroughputRequest", "run_throughput", "throughput_job", "time_split", "table",
           "throughput_report"]


@dataclasses.dataclass(frozen=True)
class ThroughputRequest:
    workloads: list[BenchWorkload]
    config: PrefixSharingConfig
    preset: ModelPreset
    token_budget: int
    repeats: int = 5
    warmup: int = 1
    dtype: torch.dtype = torch.float32
    progress: bool = True
    cross_micro_batch: bool = False
    model_settings: dict = dataclasses.field(default_factory=dict)  # e.g. activation recompute

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise InputError(f"--token-budget must be at least 1; got {self.token_budget}")
        for w in self.workloads if not self.cross_micro_batch else ():
            longest = max(len(s) for s in w.sequences)
            if longest > self.token_budget:
                raise InputError(f"--token-budget {self.token_budget} is below the longest "
                                 f"sequence of workload {w.name!r} ({longest} tokens)")


def run_throughput(engine, request: ThroughputRequest) -> list[dict]:
    """Runs :func:`throughput_job` in one rank of ``engine``; one result per workload."""
    if engine.name != "megatron":
        raise InputError(f"--token-budget runs on the megatron engine; got --engine {engine.name}")
    engine.check_installed()
    return run_distributed(throughput_job, 1, request, timeout=3600)[0]


def throughput_report(args, engine, model: ModelPreset, config: PrefixSharingConfig,
                      workloads: list[BenchWorkload], dtype: torch.dtype) -> tuple[dict, str]:
    """``prefix-sharing bench --token-budget N``: runs the view; its JSON report and its
    table (the command prints one, ``--record`` saves both)."""
    if args.plot:
        raise InputError("--plot draws the step bench (speedup against FLOP ratio); "
                         "leave it out with --token-budget")
    request = ThroughputRequest(workloads, config, model, args.token_budget,
                                repeats=args.repeats, dtype=dtype,
                                cross_micro_batch=args.cross_micro_batch,
                                model_settings=recompute_settings(args.recompute))
    if request.cross_micro_batch:
        check_cross(request)
    results = run_throughput(engine, request)
    report = {"engine": engine.name, "model": model.name, "dtype": args.dtype,
              "token_budget": args.token_budget, "recompute": args.recompute,
              "repeats": args.repeats, "results": results}
    return report, table(results)


def throughput_job(rank: int, request: ThroughputRequest) -> list[dict]:
    """Runs in one rank (see :mod:`prefix_sharing.engines.launch`)."""
    from .megatron import preset_model

    if not torch.cuda.is_available():
        keep_freed_memory_in_heap()
    model = preset_model(request.preset, layout="shared", dtype=request.dtype,
                         **request.model_settings)
    splits = [_splits(w, request) for w in request.workloads]
    steps = sum(len(s.micro_batches) for pair in splits for s in pair.values())
    steps += 2 * len(request.workloads) if request.cross_micro_batch else 0  # whole, cross
    progress = Progress(steps * (request.warmup + request.repeats), request.progress)
    results = [time_split(model, w, s, request, progress) for w, s in zip(request.workloads, splits)]
    progress.close()
    return results


def _splits(workload: BenchWorkload, request: ThroughputRequest) -> dict[str, MicroBatchSplit]:
    plain = dataclasses.replace(request.config, mode="off")
    return {"plain": split_micro_batches(workload.sequences, request.token_budget, plain),
            "shared": split_micro_batches(workload.sequences, request.token_budget, request.config)}


def time_split(model: torch.nn.Module, workload: BenchWorkload,
               splits: dict[str, MicroBatchSplit], request: ThroughputRequest,
               progress: Progress | None = None) -> dict:
    """Times one batch through each split's micro-batches; the report of one workload."""
    configs = {"plain": dataclasses.replace(request.config, mode="off"), "shared": request.config}
    steps = {
        mode: [megatron_training_step(model, _subset(workload, mb), configs[mode])
               for mb in split.micro_batches]
        for mode, split in splits.items()
    }
    if request.cross_micro_batch:
        steps["whole"] = [megatron_training_step(model, workload, request.config)]
        steps["cross"] = [cross_training_step(model, workload, request)]
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for i in range(request.warmup + request.repeats):
        for mode, micro_steps in steps.items():  # interleaved: plain batch, shared batch, ...
            elapsed = 0.0
            for step in micro_steps:
                if progress is not None:
                    progress.advance(f"{workload.name} {mode}")
                elapsed += timed(step)
            if i >= request.warmup:
                times[mode].append(elapsed)
    n = len(workload.sequences)
    result: dict = {"workload": workload.name, "sequences": n, "token_budget": request.token_budget}
    for mode, split in splits.items():
        batch_s = statistics.median(times[mode])
        result[mode] = {
            "micro_batches": len(split.micro_batches),
            "sequences_per_micro_batch": n / len(split.micro_batches),
            "max_tokens_total": max(split.tokens_total),
            "max_tokens_computed": max(split.tokens_computed),
            "groups_split": split.groups_split,
            "token_ratio": split.token_ratio,
            "batch_ms": batch_s * 1e3,
            "batch_steps_ms": [t * 1e3 for t in times[mode]],
            "sequences_per_s": n / batch_s,
            "oversized": len(split.oversized),
        }
    result["throughput_ratio"] = (result["shared"]["sequences_per_s"]
                                  / result["plain"]["sequences_per_s"])
    if request.cross_micro_batch:
        batch_s = statistics.median(times["cross"])
        figures = _cross_run(model, workload, request, collect=False).report()
        result["cross"] = {
            **figures,
            "micro_batches": figures["num_micro_batches"],
            "sequences_per_micro_batch": n / figures["num_micro_batches"],
            "groups_split": 0,
            "batch_ms": batch_s * 1e3,
            "batch_steps_ms": [t * 1e3 for t in times["cross"]],
            "sequences_per_s": n / batch_s,
        }
        result["cross_throughput_ratio"] = n / batch_s / result["plain"]["sequences_per_s"]
        _against_whole(model, workload, request, splits, steps, times, result)
    return result


def _against_whole(model: torch.nn.Module, workload: BenchWorkload, request: ThroughputRequest,
                   splits: dict[str, MicroBatchSplit], steps: dict[str, list[Callable[[], None]]],
                   times: dict[str, list[float]], result: dict) -> None:
    """The cross view's figures per mode, each against ``whole`` (see the module doc)."""
    configs = {"plain": dataclasses.replace(request.config, mode="off"), "shared": request.config}
    plans = {mode: [build_plan([workload.sequences[i] for i in mb], configs[mode])
                    for mb in split.micro_batches] for mode, split in splits.items()}
    plans["whole"] = [build_plan(workload.sequences, request.config)]
    schedules = [plan_group([workload.sequences[i] for i in members], request.token_budget,
                            request.config) for members in _groups(workload)]
    plans["cross"] = [p for s in schedules
                      for p in [b.plan for b in s.blocks] + [x.plan for x in s.suffixes]]
    whole_s = statistics.median(times["whole"])
    result["whole"] = {"micro_batches": 1, "sequences_per_micro_batch": float(len(workload.sequences)),
                       "max_tokens_computed": plans["whole"][0].num_tokens_unique,
                       "groups_split": 0, "batch_ms": whole_s * 1e3,
                       "batch_steps_ms": [t * 1e3 for t in times["whole"]],
                       "sequences_per_s": len(workload.sequences) / whole_s}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(request.config.backend, device, request.dtype)
    for mode, mode_plans in plans.items():
        flops = [count_flops(p, request.preset) for p in mode_plans]
        model.zero_grad(set_to_none=True)  # every measured step starts without gradients
        entry = result[mode]
        entry["tokens_computed"] = sum(p.num_tokens_unique for p in mode_plans)
        held = [key_rows(p, backend=backend) for p in mode_plans]
        entry["kv_execution"] = sorted({h.execution for h in held})
        entry["kv_rows_per_layer"] = max(h.kv_rows for h in held)
        entry["kv_rows_gather"] = max(key_rows(p, execution="gather").kv_rows
                                      for p in mode_plans)
        entry["flops"] = sum(f.plain if mode == "plain" else f.shared for f in flops)
        entry["peak_mb"] = peak_memory_bytes(lambda: [step() for step in steps[mode]]) / 2**20
    whole = result["whole"]
    for mode in plans:
        result[mode]["vs_whole"] = {
            "time": result[mode]["batch_ms"] / whole["batch_ms"],
            "tokens": result[mode]["tokens_computed"] / whole["tokens_computed"],
            "flops": result[mode]["flops"] / whole["flops"],
            "peak": result[mode]["peak_mb"] / whole["peak_mb"]}


def check_cross(request: ThroughputRequest) -> None:
    """What the cross mode cannot run, as one line before the rank starts."""
    for w in request.workloads:
        for members in _groups(w):
            try:
                plan_group([w.sequences[i] for i in members], request.token_budget,
                           request.config)
            except ValueError as e:
                raise InputError(f"workload {w.name!r}: {e}") from e


def cross_training_step(model: torch.nn.Module, workload: BenchWorkload,
                        request: ThroughputRequest) -> Callable[[], None]:
    """One trainer step on ``workload`` across micro-batches (planning included)."""
    return lambda: _cross_run(model, workload, request, collect=False)


def _cross_run(model: torch.nn.Module, workload: BenchWorkload, request: ThroughputRequest,
               collect: bool):
    from .cross_micro_batch import forward_backward_cross

    return forward_backward_cross(model, workload.sequences, request.token_budget,
                                  request.config, groups=_groups(workload), collect=collect)


def _groups(workload: BenchWorkload) -> list[list[int]]:
    """The workload's prompt groups, or the whole workload as one group."""
    if workload.groups is None:
        return [list(range(len(workload.sequences)))]
    return [list(g.members) for g in workload.groups]


def table(results: list[dict]) -> str:
    """The text view of :func:`throughput_job`'s results."""
    header = (f"{'workload':<10} {'budget':>7} {'mode':<7} {'micro-b':>7} {'seq/mb':>7} "
              f"{'max tok':>8} {'split':>6} {'batch ms':>9} {'seq/s':>8} {'seq/s x':>8}")
    lines = [header]
    ratios = {"shared": "throughput_ratio", "cross": "cross_throughput_ratio"}
    for r in results:
        for mode in ("plain", "shared", "cross", "whole"):
            if mode not in r:
                continue
            e = r[mode]
            ratio = f"{r[ratios[mode]]:>8.2f}" if mode in ratios else f"{'':>8}"
            lines.append(
                f"{r['workload']:<10} {r['token_budget']:>7} {mode:<7} {e['micro_batches']:>7} "
                f"{e['sequences_per_micro_batch']:>7.2f} {e['max_tokens_computed']:>8} "
                f"{e['groups_split']:>6} {e['batch_ms']:>9.0f} {e['sequences_per_s']:>8.1f} {ratio}")
    lines += ["", "budget: tokens a micro-batch may compute (plain: all its tokens; shared: after "
              "sharing); max tok: the fullest micro-batch; split: groups cut across micro-batches; "
              "seq/s x: shared/plain sequences per second (median batch time)"]
    if any("cross" in r for r in results):
        lines.append("cross: each group's prefix once across micro-batches (prefix + suffix "
                     "micro-batches); whole: the workload as one shared micro-batch, the "
                     "budget ignored")
        lines += ["", _against_whole_table(results)]
    return "\n".join(lines)


def _against_whole_table(results: list[dict]) -> str:
    """The cross view's second table: what each mode computes and holds, against ``whole``."""
    lines = [f"{'workload':<10} {'mode':<7} {'tokens':>7} {'GFLOP':>8} {'peak MB':>8} "
             f"{'held MB':>8} {'K/V rows':>13} {'time x':>7} {'tok x':>6} {'flop x':>7} "
             f"{'peak x':>7}"]
    for r in results:
        for mode in ("whole", "plain", "shared", "cross"):
            e = r[mode]
            held = f"{e['held_bytes'] / 2**20:>8.1f}" if "held_bytes" in e else f"{'-':>8}"
            rows = (f"{e['kv_rows_per_layer']}/{e['kv_rows_gather']}"
                    if "kv_rows_per_layer" in e else "-")  # result files before the column
            x = e["vs_whole"]
            lines.append(
                f"{r['workload']:<10} {mode:<7} {e['tokens_computed']:>7} "
                f"{e['flops'] / 1e9:>8.1f} {e['peak_mb']:>8.0f} {held} {rows:>13} "
                f"{x['time']:>7.2f} {x['tokens']:>6.2f} {x['flops']:>7.2f} {x['peak']:>7.2f}")
    lines += ["", "tokens, GFLOP: computed by the batch's micro-batches (forward + backward); "
              "peak MB: the batch's step (a separate run); held MB: K/V leaves and gradients "
              "kept across micro-batches; K/V rows: the most one attention layer holds in a "
              "micro-batch (its execution's / with every key segment gathered; cross: beside "
              "the stored blocks it reads in place, which held MB counts); x: against whole "
              "(time: median batch time)"]
    return "\n".join(lines)


def _subset(workload: BenchWorkload, indices: list[int]) -> BenchWorkload:
    """The sequences of one micro-batch (no prompt groups: the split already grouped them)."""
    return BenchWorkload(workload.name, [workload.sequences[i] for i in indices], None)
