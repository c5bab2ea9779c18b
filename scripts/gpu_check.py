#!/usr/bin/env python
"""GPU check: the prefix-sharing Megatron path per attention backend, equivalence and speed.

Run on a machine with one CUDA GPU (a single rank, in this process; one to two minutes on an
H100 with the default ``small`` preset)::

    python scripts/gpu_check.py --markdown docs/gpu_check.md --json docs/gpu_check.json

0. Probe, per backend (``flash_attn``, ``te``, ``flex``, ``torch``): the kernel's module imports
   (``transformer_engine.pytorch``, not just ``transformer_engine``, which imports without its
   PyTorch extension) and one small prefix-shaped call runs forward and backward and matches
   the torch kernel (THD, GQA, bottom-right causal, fewer queries than keys: TE needs cuDNN
   >= 9.6 for it, 9.7 with unpadded max lengths, or a flash-attn it accepts). A backend that
   fails is reported with the reason as a skipped row, never as passed, and never runs.
1. Equivalence, per runnable backend: the shared run of a GPTModel against megatron's stock
   local spec on padded input, same weights, on GRPO, step-wise, tree, agent and unshared
   micro-batches, judged by flash-attn's rule: no further from the plain run in higher
   precision (float64 for fp32 - torch only: flash-attn has no fp32 kernel -, fp32 holding the
   same rounded weights for bf16) than 2x (grads 3x) megatron's own run is. With TE, also
   the Transformer Engine layer spec (TE linears and norms) against megatron's stock TE spec.
2. Timing, per backend, bf16: forward+backward of megatron's stock THD step - today's
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

BACKENDS = ("flash_attn", "te", "flex", "torch")
# flash-attn and TE compute in half precision only; FlexAttention and the torch reference
# kernel run both.
CHECK_DTYPES = {"flash_attn": (torch.bfloat16,), "te": (torch.bfloat16,),
                "flex": (torch.float32, torch.bfloat16), "torch": (torch.float32, torch.bfloat16)}
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
    if row["result"] == "skipped":
        return f"skipped: {row['status']}"
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
    "Columns: largest difference of each quantity from the plain run in higher precision (float64 "
    "for fp32 rows, fp32 for bf16 rows), relative to its scale (logits restored to every token, "
    "per-token log-probs and entropy, a policy-gradient loss, every parameter gradient). A row "
    "passes within 2x (grads 3x) the error of megatron's own run in its dtype, plus a floor of "
    "a few ulps; the `stock` rows show megatron's own bf16 error."
)
TIMING_LEGEND = (
    "Forward+backward (log-probs, entropy, loss, backward) of one micro-batch in bf16: `plain` is "
    "megatron's stock THD step (plain PackedSeqParams, verl's packing, nothing shared), `shared` "
    "the prefix-sharing layout, same model and attention kernel. Medians of interleaved steps. "
    "`flops`: FLOP ratio plain/shared (the physical limit); `speedup`: plain_ms/shared_ms; "
    "`of_flops`: speedup/flops; `*_MiB`: the "
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
# The module each kernel is called from. transformer_engine itself imports even when its
# PyTorch extension (transformer_engine.pytorch) cannot load, so that is what is probed.
KERNEL_MODULES = {"flash_attn": "flash_attn", "te": "transformer_engine.pytorch"}
TE_CUDNN_HINT = ("TE's THD attention with GQA and a bottom-right causal mask needs cuDNN >= 9.6 "
                 "(9.7 with unpadded max lengths) or a flash-attn version TE accepts")


def probe_backends(device: torch.device,
                   smoke: Callable[[str, torch.device], str | None] | None = None,
                   import_module: Callable[[str], Any] = importlib.import_module,
                   ) -> dict[str, dict[str, str | None]]:
    """Per backend: ``status`` ("available", "not installed", "import failed: ...", "needs
    CUDA", "cannot run: ...") and the kernel package's ``version`` (None when it does not
    import). ``smoke(name, device)`` runs the kernel once and returns why it cannot run (None
    when it can): :func:`kernel_smoke_test` unless given."""
    smoke = kernel_smoke_test if smoke is None else smoke
    found = {}
    for name in BACKENDS:
        package = BACKEND_FUNCTIONS[name][2]  # the kernel package; None: torch itself
        if name == "torch":
            found[name] = {"status": "available", "version": torch.__version__}
            continue
        version = torch.__version__  # FlexAttention: in torch, with a backward on CUDA only
        if package is not None:
            try:
                top = import_module(package)
            except ModuleNotFoundError as error:
                status = "not installed" if error.name == package else f"import failed: {error}"
                found[name] = {"status": status, "version": None}
                continue
            except Exception as error:  # a wheel built against another torch fails many ways
                found[name] = {"status": f"import failed: {_reason(error)}", "version": None}
                continue
            version = getattr(top, "__version__", "?")
            try:
                import_module(KERNEL_MODULES.get(name, package))
            except Exception as error:
                found[name] = {"status": f"import failed: {KERNEL_MODULES[name]}: "
                               f"{_reason(error)}", "version": version}
                continue
        if device.type != "cuda":
            found[name] = {"status": "needs CUDA", "version": version}
            continue
        reason = smoke(name, device)
        found[name] = {"status": "available" if reason is None else f"cannot run: {reason}",
                       "version": version}
    return found


def kernel_smoke_test(name: str, device: torch.device) -> str | None:
    """Why ``name``'s kernel cannot compute a small prefix-shaped bf16 attention on ``device``
    (forward and backward, against the torch kernel), or None when it can."""
    from prefix_sharing.attention import varlen_attention

    gen = torch.Generator().manual_seed(0)
    # two segments reading 4 and 0 keys of prefix: 3 queries over 7 keys, 5 over 5; GQA 4:2
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32) for b in ([0, 3, 8], [0, 7, 12]))
    q, k, v = (torch.randn(n, h, 64, generator=gen) for n, h in ((8, 4), (12, 2), (12, 2)))
    outs = {}
    try:
        for backend in (name, "torch"):
            leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in (q, k, v)]
            out = varlen_attention(*leaves, cu_q.to(device), cu_k.to(device), 5, 7,
                                   backend=backend)
            out.float().square().sum().backward()
            outs[backend] = [out.detach().float(), *(t.grad.float() for t in leaves)]
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as error:
        hint = f" ({TE_CUDNN_HINT}; torch has cuDNN {_cudnn_version()})" if name == "te" else ""
        return f"{_reason(error)}{hint}"
    worst = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(outs[name], outs["torch"]))
    if worst > SMOKE_RTOL:
        return f"differs from the torch kernel by {worst:.1e} relative (allowed {SMOKE_RTOL})"
    return None


SMOKE_RTOL = 5e-2  # bf16 inputs, bf16 outputs: a few ulps on an unscaled tensor


def _cudnn_version() -> str:
    version = torch.backends.cudnn.version()
    if version is None:
        return "none"
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _reason(error: BaseException) -> str:
    """``Type: first line of the message``: a table cell, not a traceback."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


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
    ``stock_rounded`` is fp32 holding the bf16 weights, the bf16 runs' reference, and
    ``stock_fp64`` the fp32 runs' (None where only bf16 is checked)."""

    shared_fp32: torch.nn.Module
    shared_bf16: torch.nn.Module
    stock_fp32: torch.nn.Module
    stock_bf16: torch.nn.Module
    stock_rounded: torch.nn.Module
    stock_fp64: torch.nn.Module | None


def build_models(preset: ModelPreset, stock_spec: Any = None, shared_spec: Any = None,
                 float64: bool = True) -> Models:
    """The models, on megatron's local specs unless given layer specs (the same parameter
    names on both sides, so the seeded weights agree); ``float64``: also the fp32 checks'
    reference."""
    stock = dict(layout="padded", layer_spec=stock_spec)
    shared = dict(layout="shared", layer_spec=shared_spec)
    stock_bf16, stock_rounded = (gpt_model(preset, dtype=torch.bfloat16, **stock),
                                 gpt_model(preset, **stock))
    with torch.no_grad():
        for p32, p16 in zip(stock_rounded.parameters(), stock_bf16.parameters(), strict=True):
            p32.copy_(p16)
    return Models(
        shared_fp32=gpt_model(preset, **shared),
        shared_bf16=gpt_model(preset, dtype=torch.bfloat16, **shared),
        stock_fp32=gpt_model(preset, **stock),
        stock_bf16=stock_bf16,
        stock_rounded=stock_rounded,
        stock_fp64=gpt_model(preset, dtype=torch.float64, **stock) if float64 else None,
    )


def build_te_spec_models(preset: ModelPreset) -> Models:
    """The models on Transformer Engine layer specs: megatron's stock one, and the
    prefix-sharing one (TE linears with fused norms, the prefix-sharing attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec as stock_te_spec,
    )

    from prefix_sharing.megatron_ext import get_gpt_layer_with_transformer_engine_spec

    return build_models(preset, stock_te_spec(), get_gpt_layer_with_transformer_engine_spec(),
                        float64=False)  # TE's kernels check bf16 only


@dataclasses.dataclass
class References:
    """One workload's plain runs, each judged against a higher-precision one on the same
    weights (flash-attn's rule, see ``within_tolerance``): float64 (the fp32 checks'
    reference) and how far megatron's own fp32 run is from it; fp32 with the rounded bf16
    weights (the bf16 checks' reference) and how far megatron's own bf16 run is from it."""

    fp64: MicroBatchRun | None
    plain_fp32: Comparison | None
    rounded: MicroBatchRun
    plain_bf16: Comparison


def plain_references(models: Models, batches: list[list[torch.Tensor]]) -> References:
    rounded = forward_backward(models.stock_rounded, batches, "padded")
    fp64 = None if models.stock_fp64 is None else forward_backward(models.stock_fp64, batches,
                                                                   "padded")
    return References(
        fp64=fp64,
        plain_fp32=None if fp64 is None else compare(
            forward_backward(models.stock_fp32, batches, "padded"), fp64),
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
                         refs.fp64 if fp32 else refs.rounded)
    plain = refs.plain_fp32 if fp32 else refs.plain_bf16
    verdict = within_tolerance(comparison, plain, dtype)
    failed = [q for q, ok in verdict.items() if not ok]
    return {"max_rel_diff": comparison.max_rel_diff, "max_abs_diff": comparison.max_abs_diff,
            "plain_max_rel_diff": plain.max_rel_diff,
            "within_tolerance": verdict, "result": "FAILED" if failed else "ok",
            "failed": failed}


def run_checks(models: Models, preset: ModelPreset, workloads: dict[str, dict[str, Any]],
               backends: list[str], spec: str = "local") -> list[dict[str, Any]]:
    """Per workload: the stock bf16 reference row, then one row per (backend, dtype).
    ``spec``: the layer spec the models were built on ("local" or "te")."""
    say(text_line(CHECK_COLUMNS))
    rows = []
    for seed, (name, sizes) in enumerate(workloads.items()):
        sequences = make_workload(name, vocab_size=preset.vocab_size, seed=seed, **sizes).sequences
        plan = build_plan(sequences, CHECK_CONFIG)
        about = {"workload": name, "sequences": len(sequences),
                 "tokens_total": plan.num_tokens_total, "tokens_unique": plan.num_tokens_unique}
        start = time.perf_counter()
        refs = plain_references(models, [sequences])
        reference_row = {**about, "backend": _label("stock", spec), "dtype": "bfloat16",
                         "result": "ref",
                         "max_rel_diff": refs.plain_bf16.max_rel_diff,
                         "seconds": time.perf_counter() - start}
        rows.append(reference_row)
        say(text_line(CHECK_COLUMNS, reference_row))
        for backend in backends:
            for dtype in CHECK_DTYPES[backend]:
                row = {**about, "backend": _label(backend, spec),
                       "dtype": str(dtype).removeprefix("torch.")}
                start = time.perf_counter()
                row.update(guarded(equivalence_check, models, refs, [sequences], backend, dtype))
                row["seconds"] = time.perf_counter() - start
                rows.append(row)
                say(text_line(CHECK_COLUMNS, row))
    return rows


def _label(backend: str, spec: str) -> str:
    return backend if spec == "local" else f"{backend}/{spec}-spec"


def skipped_rows(backends: dict[str, dict[str, str | None]]) -> list[dict[str, Any]]:
    """One row per backend that cannot run here, with the reason: reported, never passed."""
    rows = [{"backend": name, "status": info["status"]} for name, info in backends.items()
            if info["status"] != "available"]
    te = backends["te"]["status"]
    if te != "available":  # the TE layer spec needs Transformer Engine's kernels
        rows.append({"backend": _label("te", "te"), "status": te})
    return [{**row, "dtype": "-", "workload": "-", "result": "skipped"} for row in rows]


def guarded_models(build: Callable[[ModelPreset], Models], preset: ModelPreset) -> Models | dict:
    """``build(preset)``, or an ERROR row naming the TE spec when building it fails."""
    try:
        return build(preset)
    except Exception as error:
        traceback.print_exc()
        return {"backend": _label("te", "te"), "dtype": "bfloat16", "workload": "-",
                "result": "ERROR", "error": f"{type(error).__name__}: {error}"}


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
    skipped = [f"{r['backend']} ({r['status']})" for r in checks if r["result"] == "skipped"]
    checks = [r for r in checks if r["result"] not in ("ref", "skipped")]
    passed = sum(r["result"] == "ok" for r in checks)
    errors = sum(r["result"] == "ERROR" for r in checks + timing)
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
    if "te" in runnable:  # the TE layer spec, which only runs with Transformer Engine's kernels
        say("\n== equivalence on Transformer Engine layer specs (TE linears and norms)")
        te_models = guarded_models(build_te_spec_models, preset)
        if isinstance(te_models, Models):
            checks += run_checks(te_models, preset, profile.checks, ["te"], spec="te")
        else:
            checks.append(te_models)
            say(text_line(CHECK_COLUMNS, te_models))
    skipped = skipped_rows(backends)
    for row in skipped:
        say(text_line(CHECK_COLUMNS, row))
    checks += skipped
    say(f"\n== timing: bf16, megatron's stock THD step vs shared, median of {args.repeats} "
        "interleaved steps")
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
