#!/usr/bin/env python
"""GPU check: the prefix-sharing Megatron path per attention backend, equivalence and speed.

Run on a machine with one CUDA GPU (a single rank, in this process; one to two minutes on an
H100 with the default ``small`` preset)::

    python scripts/gpu_check.py --markdown docs/gpu_check.md --json docs/gpu_check.json

1. Equivalence, per backend (``flash_attn``, ``te``, ``torch``; a backend whose package does not
   import is reported as such, never as passed): the shared run of a GPTModel against megatron's
   stock local spec on padded input, same weights, on GRPO, step-wise, tree, agent and unshared
   micro-batches. fp32 (torch only: flash-attn has no fp32 kernel) within 1e-5 relative; bf16 by
   flash-attn's rule, against an fp32 reference holding the same rounded weights.
2. Timing, per backend, bf16: forward+backward of the plain packed (THD) layout - today's
   training step - and of the shared layout on the same model, interleaved, medians; speedup
   against the FLOP ratio, peak memory and planning time.

The exit status is 1 when a check fails or a step raises. ``--device cpu`` (the default without
CUDA) runs the torch backend on the tiny preset and tiny workloads: the smoke test CI runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import megatron.core
import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention.backends import BACKEND_FUNCTIONS
from prefix_sharing.engines.bench import BenchRequest, BenchWorkload, time_workload
from prefix_sharing.engines.launch import free_port, init_megatron
from prefix_sharing.engines.megatron import (
    MicroBatchRun,
    compare,
    forward_backward,
    gpt_model,
)
from prefix_sharing.presets import PRESETS, ModelPreset, get_preset
from prefix_sharing.equivalence import QUANTITIES, Comparison, within_tolerance
from prefix_sharing.workloads import make_workload

BACKENDS = ("flash_attn", "te", "torch")
# flash-attn and TE compute in half precision only; the torch reference kernel runs both.
CHECK_DTYPES = {"flash_attn": (torch.bfloat16,), "te": (torch.bfloat16,),
                "torch": (torch.float32, torch.bfloat16)}
# Equivalence shares every common prefix, however short, to exercise the most segments.
CHECK_CONFIG = PrefixSharingConfig(min_prefix_len=1)
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Profile:
    """What one device runs: the default preset and the workloads' sizes (``make_workload``)."""

    preset: str
    checks: dict[str, dict[str, Any]]
    timing: dict[str, dict[str, Any]]


PROFILES = {
    # Checks: a few thousand tokens each, seconds on an H100. Timing: 90k-200k tokens a step.
    "cuda": Profile(
        preset="small",
        checks={
            "grpo": dict(num_prompts=4, group_size=4, prompt_len=(64, 256), response_len=(32, 256)),
            "steprl": dict(num_chains=2, num_steps=6, prompt_len=(64, 256), step_len=(16, 64)),
            "tree": dict(depth=3, branching=3, prompt_len=(64, 256), node_len=(16, 64)),
            "agent": dict(num_tasks=2, num_turns=3, branching=2, system_len=128,
                          task_len=(16, 64), turn_len=(16, 64)),
            "none": dict(num_sequences=8, seq_len=(64, 512)),
        },
        timing={
            # 8 prompts x 8 responses, 1k-2k tokens each
            "grpo": dict(num_prompts=8, group_size=8, prompt_len=(1024, 2048),
                         response_len=(1024, 2048)),
            # 81 leaves (plus a duplicate and a strict prefix) under a 1k-token prompt
            "tree": dict(depth=4, branching=3, prompt_len=(1024, 1024), node_len=(128, 256)),
            # 4 tasks x 8 episodes of 4 turns under a 1k-token system prompt
            "agent": dict(num_tasks=4, num_turns=4, branching=2, system_len=1024,
                          task_len=(128, 256), turn_len=(128, 256)),
            "none": dict(num_sequences=32, seq_len=(2048, 4096)),
        },
    ),
    # The workloads' tiny defaults, some shrunk further: seconds on a 2-core CPU.
    "cpu": Profile(
        preset="tiny",
        checks={"grpo": dict(num_prompts=2, group_size=3), "steprl": dict(num_chains=1),
                "tree": dict(depth=2), "agent": dict(num_tasks=1), "none": dict(num_sequences=4)},
        timing={"grpo": {}, "tree": {}, "agent": dict(num_tasks=1), "none": {}},
    ),
}


# ----------------------------------------------------------------------------- tables
@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a result table, printed fixed-width on stdout and as markdown."""

    header: str
    width: int
    cell: Callable[[dict[str, Any]], str]
    align: str = ">"


def _num(key: str, spec: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: "-" if row.get(key) is None else format(row[key], spec)


def _diff(quantity: str) -> Callable[[dict[str, Any]], str]:
    def cell(row: dict[str, Any]) -> str:
        diffs = row.get("max_rel_diff")
        return "-" if diffs is None else format(diffs[quantity], ".1e")

    return cell


def _result(row: dict[str, Any]) -> str:
    """ok / ref / FAILED and the quantities out of tolerance / ERROR and the exception type."""
    if row["result"] == "ERROR":
        return f"ERROR ({row['error'].split(':')[0]})"
    return " ".join([row["result"], *row.get("failed", [])])


CHECK_COLUMNS = [
    Column("backend", 10, lambda r: r["backend"], "<"),
    Column("dtype", 8, lambda r: r["dtype"], "<"),
    Column("workload", 8, lambda r: r["workload"], "<"),
    Column("seqs", 4, _num("sequences", "d")),
    Column("tokens", 6, _num("tokens_total", "d")),
    Column("unique", 6, _num("tokens_unique", "d")),
    *(Column(q, 9, _diff(q)) for q in QUANTITIES),
    Column("s", 5, _num("seconds", ".2f")),
    Column("result", 6, _result, "<"),
]
TIMING_COLUMNS = [
    Column("backend", 10, lambda r: r["backend"], "<"),
    Column("workload", 8, lambda r: r["workload"], "<"),
    Column("seqs", 4, _num("sequences", "d")),
    Column("tokens", 7, _num("tokens_total", "d")),
    Column("unique", 7, _num("tokens_unique", "d")),
    Column("flops", 5, _num("flop_ratio", ".2f")),
    Column("plain_ms", 8, _num("plain_ms", ".1f")),
    Column("shared_ms", 9, _num("shared_ms", ".1f")),
    Column("speedup", 7, _num("speedup", ".2f")),
    Column("of_flops", 8, _num("speedup_vs_flop_ratio", ".2f")),
    Column("plain_MiB", 9, _num("plain_peak_mb", ".0f")),
    Column("shared_MiB", 10, _num("shared_peak_mb", ".0f")),
    Column("mem", 5, _num("memory_ratio", ".2f")),
    Column("plan_ms", 7, _num("planner_ms", ".1f")),
    Column("result", 6, _result, "<"),
]
CHECK_LEGEND = (
    "Columns: largest difference of each quantity from the fp32 plain run, relative to its scale "
    "(logits restored to every token, per-token log-probs and entropy, a policy-gradient loss, "
    "every parameter gradient). fp32 passes within 1e-5; bf16 within 2x (grads 3x) the error of "
    "megatron's own bf16 run, shown in the `stock` rows."
)
TIMING_LEGEND = (
    "Forward+backward (log-probs, entropy, loss, backward) of one micro-batch in bf16: `plain` is "
    "the packed THD layout with nothing shared, `shared` the prefix-sharing layout, same model and "
    "attention kernel. Medians of interleaved steps. `flops`: FLOP ratio plain/shared (the "
    "physical limit); `speedup`: plain_ms/shared_ms; `of_flops`: speedup/flops; `*_MiB`: the "
    "most memory the step held at once beyond what was held before it; `mem`: "
    "plain_MiB/shared_MiB; `plan_ms`: the planner alone (each step plans, so shared_ms "
    "includes it). The JSON also holds the prompt-only sharing of each workload's prompt groups."
)


def text_line(columns: Sequence[Column], row: dict[str, Any] | None = None) -> str:
    """One fixed-width line: the headers when ``row`` is None."""
    cells = [c.header if row is None else c.cell(row) for c in columns]
    return " ".join(format(cell, f"{c.align}{c.width}") for c, cell in zip(columns, cells)).rstrip()


def markdown_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---" if c.align == "<" else "---:" for c in columns) + "|"]
    return lines + ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]


def say(line: str) -> None:
    print(line, flush=True)


# ----------------------------------------------------------------------------- environment
def probe_backends(device: torch.device) -> dict[str, dict[str, str | None]]:
    """Per backend: ``status`` ("available", "not installed", "import failed: ...", "needs
    CUDA") and the kernel package's ``version`` (None when it does not import)."""
    found = {}
    for name in BACKENDS:
        package = BACKEND_FUNCTIONS[name][2]  # the kernel package; None for torch
        try:
            module = torch if package is None else importlib.import_module(package)
        except ModuleNotFoundError as error:
            status = "not installed" if error.name == package else f"import failed: {error}"
            found[name] = {"status": status, "version": None}
            continue
        except Exception as error:  # a wheel built against another torch fails in many ways
            found[name] = {"status": f"import failed: {type(error).__name__}: {error}",
                           "version": None}
            continue
        needs_cuda = package is not None and device.type != "cuda"
        found[name] = {"status": "needs CUDA" if needs_cuda else "available",
                       "version": getattr(module, "__version__", "?")}
    return found


def describe_backends(backends: dict[str, dict[str, str | None]]) -> str:
    return "; ".join(f"{name} {info['version'] or ''}".rstrip() + f": {info['status']}"
                     for name, info in backends.items())


def environment(device: torch.device, preset: ModelPreset,
                backends: dict[str, dict[str, str | None]]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "megatron_core": megatron.core.__version__,
        "flash_attn": backends["flash_attn"]["version"] or backends["flash_attn"]["status"],
        "transformer_engine": backends["te"]["version"] or backends["te"]["status"],
        "preset": dataclasses.asdict(preset),
        "command": " ".join(["python", *sys.argv]),
    }


# ----------------------------------------------------------------------------- equivalence
@dataclasses.dataclass
class Models:
    """The prefix-sharing GPTModel in both dtypes and megatron's stock one on padded input;
    ``stock_rounded`` is fp32 holding the bf16 weights, the bf16 runs' reference."""

    shared_fp32: torch.nn.Module
    shared_bf16: torch.nn.Module
    stock_fp32: torch.nn.Module
    stock_bf16: torch.nn.Module
    stock_rounded: torch.nn.Module


def build_models(preset: ModelPreset) -> Models:
    stock_bf16, stock_rounded = (gpt_model(preset, layout="padded", dtype=torch.bfloat16),
                                 gpt_model(preset, layout="padded"))
    with torch.no_grad():
        for p32, p16 in zip(stock_rounded.parameters(), stock_bf16.parameters(), strict=True):
            p32.copy_(p16)
    return Models(
        shared_fp32=gpt_model(preset, layout="shared"),
        shared_bf16=gpt_model(preset, layout="shared", dtype=torch.bfloat16),
        stock_fp32=gpt_model(preset, layout="padded"),
        stock_bf16=stock_bf16,
        stock_rounded=stock_rounded,
    )


@dataclasses.dataclass
class References:
    """One workload's plain runs: fp32 (the fp32 check's reference), fp32 with the rounded bf16
    weights (the bf16 checks' reference) and how far megatron's own bf16 run is from it."""

    fp32: MicroBatchRun
    rounded: MicroBatchRun
    plain_bf16: Comparison


def plain_references(models: Models, batches: list[list[torch.Tensor]]) -> References:
    rounded = forward_backward(models.stock_rounded, batches, "padded")
    return References(
        fp32=forward_backward(models.stock_fp32, batches, "padded"),
        rounded=rounded,
        plain_bf16=compare(forward_backward(models.stock_bf16, batches, "padded"), rounded),
    )


def equivalence_check(models: Models, refs: References, batches: list[list[torch.Tensor]],
                      backend: str, dtype: torch.dtype) -> dict[str, Any]:
    """The shared run on ``backend`` against the plain reference of its dtype."""
    fp32 = dtype == torch.float32
    model = models.shared_fp32 if fp32 else models.shared_bf16
    config = dataclasses.replace(CHECK_CONFIG, backend=backend)
    comparison = compare(forward_backward(model, batches, "shared", config),
                         refs.fp32 if fp32 else refs.rounded)
    verdict = within_tolerance(comparison, None if fp32 else refs.plain_bf16)
    failed = [q for q, ok in verdict.items() if not ok]
    return {"max_rel_diff": comparison.max_rel_diff, "max_abs_diff": comparison.max_abs_diff,
            "plain_bf16_max_rel_diff": None if fp32 else refs.plain_bf16.max_rel_diff,
            "within_tolerance": verdict, "result": "FAILED" if failed else "ok",
            "failed": failed}


def run_checks(models: Models, preset: ModelPreset, workloads: dict[str, dict[str, Any]],
               backends: list[str]) -> list[dict[str, Any]]:
    """Per workload: the stock bf16 reference row, then one row per (backend, dtype)."""
    say(text_line(CHECK_COLUMNS))
    rows = []
    for seed, (name, sizes) in enumerate(workloads.items()):
        sequences = make_workload(name, vocab_size=preset.vocab_size, seed=seed, **sizes).sequences
        plan = build_plan(sequences, CHECK_CONFIG)
        about = {"workload": name, "sequences": len(sequences),
                 "tokens_total": plan.num_tokens_total, "tokens_unique": plan.num_tokens_unique}
        start = time.perf_counter()
        refs = plain_references(models, [sequences])
        reference_row = {**about, "backend": "stock", "dtype": "bfloat16", "result": "ref",
                         "max_rel_diff": refs.plain_bf16.max_rel_diff,
                         "seconds": time.perf_counter() - start}
        rows.append(reference_row)
        say(text_line(CHECK_COLUMNS, reference_row))
        for backend in backends:
            for dtype in CHECK_DTYPES[backend]:
                row = {**about, "backend": backend, "dtype": str(dtype).removeprefix("torch.")}
                start = time.perf_counter()
                row.update(guarded(equivalence_check, models, refs, [sequences], backend, dtype))
                row["seconds"] = time.perf_counter() - start
                rows.append(row)
                say(text_line(CHECK_COLUMNS, row))
    return rows


def guarded(step: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``step(*args)``, or an ERROR row with the traceback on stderr: one failing kernel must
    not lose the other backends' results."""
    try:
        return step(*args)
    except Exception as error:
        traceback.print_exc()
        return {"result": "ERROR", "error": f"{type(error).__name__}: {error}"}


# ----------------------------------------------------------------------------- timing
def run_timing(model: torch.nn.Module, preset: ModelPreset, workloads: dict[str, dict[str, Any]],
               backends: list[str], repeats: int) -> list[dict[str, Any]]:
    """The engine's bench step per backend and workload (plain packed vs shared, interleaved,
    plus prompt-only sharing of the workload's prompt groups)."""
    say(text_line(TIMING_COLUMNS))
    rows = []
    for backend in backends:
        request = BenchRequest([], PrefixSharingConfig(backend=backend), preset, repeats=repeats,
                               warmup=WARMUP_STEPS, progress=False)
        for seed, (name, sizes) in enumerate(workloads.items()):
            w = make_workload(name, vocab_size=preset.vocab_size, seed=seed, **sizes)
            row = {"backend": backend, "workload": name, "sequences": len(w.sequences)}
            row.update(guarded(_timed_row, model, BenchWorkload(name, w.sequences, w.groups), request))
            rows.append(row)
            say(text_line(TIMING_COLUMNS, row))
    return rows


def _timed_row(model: torch.nn.Module, workload: BenchWorkload, request: BenchRequest) -> dict:
    return {**time_workload(model, workload, request), "result": "ok"}


# ----------------------------------------------------------------------------- reports
def markdown_report(report: dict[str, Any]) -> str:
    env, preset = report["environment"], report["environment"]["preset"]
    cuda = f" (CUDA {env['cuda']})" if env["cuda"] else ""
    lines = [
        f"# GPU check: {env['device']}",
        "",
        f"- date: {env['date']}",
        f"- versions: torch {env['torch']}{cuda}, megatron-core {env['megatron_core']}, "
        f"flash-attn {env['flash_attn']}, transformer-engine {env['transformer_engine']}, "
        f"Python {env['python']}",
        f"- model: preset `{preset['name']}` ({preset['num_layers']} layers, hidden "
        f"{preset['hidden_size']}, {preset['num_attention_heads']} heads over "
        f"{preset['num_query_groups']} K/V groups, vocab {preset['vocab_size']}), random weights",
        f"- backends: {describe_backends(report['backends'])}",
        f"- command: `{env['command']}`",
        f"- result: {report['summary']}",
        "",
        "## Equivalence: shared vs megatron's stock spec on padded input, same weights",
        "",
        CHECK_LEGEND,
        "",
        *markdown_table(CHECK_COLUMNS, report["equivalence"]),
        "",
        f"## Timing: {report['settings']['repeats']} interleaved steps after {WARMUP_STEPS} "
        "warm-up steps",
        "",
        TIMING_LEGEND,
        "",
        *markdown_table(TIMING_COLUMNS, report["timing"]),
    ]
    return "\n".join(lines) + "\n"


def summary(checks: list[dict[str, Any]], timing: list[dict[str, Any]],
            backends: dict[str, dict[str, str | None]]) -> tuple[bool, str]:
    checks = [r for r in checks if r["result"] != "ref"]
    passed = sum(r["result"] == "ok" for r in checks)
    errors = sum(r["result"] == "ERROR" for r in checks + timing)
    skipped = [f"{n} ({b['status']})" for n, b in backends.items() if b["status"] != "available"]
    ok = passed == len(checks) and errors == 0
    text = (f"{passed}/{len(checks)} equivalence checks passed, {errors} errors; "
            f"skipped: {', '.join(skipped) or 'none'}")
    return ok, text


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="default: cuda when available, else cpu")
    parser.add_argument("--model", choices=list(PRESETS),
                        help="model preset (default: small on cuda, tiny on cpu); the timing "
                        "workloads are sized for small's 8k vocabulary")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--markdown", type=Path, help="write a short report here (for docs/)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: torch sees no CUDA device")
    if args.device == "cpu" and cuda:
        # the engine runs wherever torch.cuda.is_available() points
        parser.error("--device cpu on a CUDA machine: hide the GPUs (CUDA_VISIBLE_DEVICES=)")
    args.device = "cuda" if cuda else "cpu"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: threads spinning on a few cores make them 20x slower
    profile = PROFILES[args.device]
    preset = get_preset(args.model or profile.preset)
    backends = probe_backends(device)
    runnable = [n for n in BACKENDS if backends[n]["status"] == "available"]
    env = environment(device, preset, backends)
    say(f"gpu_check on {env['device']}: preset {preset.name}, torch {env['torch']}, "
        f"megatron-core {env['megatron_core']}")
    say("backends: " + describe_backends(backends))

    init_megatron(0, 1, free_port())
    models = build_models(preset)
    say("\n== equivalence: shared vs megatron's stock spec on padded input, same weights")
    checks = run_checks(models, preset, profile.checks, runnable)
    say(f"\n== timing: bf16, plain packed vs shared, median of {args.repeats} interleaved steps")
    timing = run_timing(models.shared_bf16, preset, profile.timing, runnable, args.repeats)
    ok, text = summary(checks, timing, backends)
    elapsed = time.perf_counter() - started
    say(f"\n{text} ({elapsed:.0f} s after imports)")

    report = {"environment": env, "backends": backends,
              "settings": {"repeats": args.repeats, "warmup_steps": WARMUP_STEPS,
                           "check_workloads": profile.checks, "timing_workloads": profile.timing,
                           "check_min_prefix_len": CHECK_CONFIG.min_prefix_len,
                           "timing_min_prefix_len": PrefixSharingConfig().min_prefix_len},
              "equivalence": checks, "timing": timing, "passed": ok, "summary": text,
              "elapsed_s": elapsed}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown_report(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
