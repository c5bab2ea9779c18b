"""``bench``: the time and memory of one training step, plain vs shared, in one process.

A step is what a trainer does per micro-batch: plan it (``prepare_micro_batch``), forward,
per-token log-probs and entropy, a policy-gradient loss, backward. The plain step is the same
model on megatron's stock THD layout (plain ``PackedSeqParams``, megatron's own THD RoPE, verl's
packing: the step verl runs today), the same attention kernel; the shared step uses the plan.
On a Gated DeltaNet hybrid the plain step's GDN layers are megatron's stock module; in a CPU
process its fla kernel calls run on this package's torch kernels
(:func:`~prefix_sharing.megatron_ext.cpu_support.enable_cpu_gated_delta_net`), the same
chunked rule and convolution the shared step runs over its schedule. Steps are timed interleaved (plain, shared, plain, shared, ...) after a warm-up, so machine
noise falls on both alike; medians are reported. Peak memory is measured in separate runs (see
:func:`peak_memory_bytes`), as the profiler slows the step down.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

from ..attention.backends import resolve_backend
from ..attention.sources import key_rows
from ..config import PrefixSharingConfig
from ..flops import count_flops
from ..planner import PromptGroup, build_plan
from ..presets import ModelPreset

__all__ = [
    "BenchRequest", "BenchWorkload", "bench_job", "time_workload", "peak_memory_bytes",
    "keep_freed_memory_in_heap", "without_profiler_chatter", "megatron_training_step",
    "timed", "Progress", "relative_spread",
]


@dataclasses.dataclass(frozen=True)
class BenchWorkload:
    name: str
    sequences: list[torch.Tensor]
    groups: list[PromptGroup] | None  # prompt groups: also time mode="prompt_only"
    # a vision-language model's images, verl's per-sample layout (engines/hf.py)
    multi_modal_inputs: list[dict | None] | None = None


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    workloads: list[BenchWorkload]
    config: PrefixSharingConfig
    preset: ModelPreset
    repeats: int = 5
    warmup: int = 1
    dtype: torch.dtype = torch.float32
    progress: bool = True


def bench_job(rank: int, request: BenchRequest) -> list[dict]:
    """Runs in one rank (see :mod:`prefix_sharing.engines.launch`); one result per workload."""
    from .megatron import preset_model

    if not torch.cuda.is_available():
        keep_freed_memory_in_heap()
    model = preset_model(request.preset, layout="shared", dtype=request.dtype)
    progress = Progress(sum(_steps(request, w) for w in request.workloads), request.progress)
    results = [time_workload(model, w, request, progress) for w in request.workloads]
    progress.close()
    return results


def time_workload(model: torch.nn.Module, workload: BenchWorkload, request: BenchRequest,
                  progress: Progress | None = None, *,
                  make_step: Callable[..., Callable[[], None]] | None = None,
                  peers: dict[str, tuple[Callable[[], None], int]] | None = None) -> dict:
    """Times the plain, shared (and prompt-only) steps of one workload on ``model``.

    ``make_step(model, workload, config) -> step`` builds the engine's training step (megatron's
    when omitted). ``peers``: other implementations' steps on the same model and batch, by name,
    each with the tokens it computes; timed and measured beside ours (``result["peers"]``).
    """
    configs = {"plain": dataclasses.replace(request.config, mode="off"), "shared": request.config}
    if workload.groups is not None:
        configs["prompt_only"] = dataclasses.replace(request.config, mode="prompt_only")
    make_step = megatron_training_step if make_step is None else make_step
    steps = {name: make_step(model, workload, cfg) for name, cfg in configs.items()}
    steps.update({name: step for name, (step, _) in (peers or {}).items()})
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(request.warmup + request.repeats):
        for name, step in steps.items():  # interleaved: plain, shared, prompt_only, plain, ...
            if progress is not None:
                progress.advance(f"{workload.name} {name}")
            elapsed = timed(step)
            if i >= request.warmup:
                times[name].append(elapsed)
    peaks = {}
    for name, step in steps.items():
        model.zero_grad(set_to_none=True)  # every measured step starts without gradients
        peaks[name] = peak_memory_bytes(step)
    result = _report(workload, request, configs, times, peaks)
    for name, (_, tokens) in (peers or {}).items():
        peer_s = statistics.median(times[name])
        result.setdefault("peers", {})[name] = {
            "tokens_computed": tokens, "ms": peer_s * 1e3,
            "steps_ms": [t * 1e3 for t in times[name]], "peak_mb": peaks[name] / 2**20,
            "speedup": statistics.median(times["plain"]) / peer_s,
            "memory_ratio": peaks["plain"] / peaks[name]}
    return result


def keep_freed_memory_in_heap() -> None:
    """Makes glibc keep freed blocks for reuse instead of returning them to the kernel.

    Torch's CPU allocator is plain malloc: every step's activations are fresh blocks whose
    pages fault in on first touch, at a cost (microseconds a page on a virtual machine) that
    varies from step to step and has no counterpart on a GPU, where the caching allocator
    reuses blocks. Keeping the heap warm measures the step's own work, and steadies it.
    """
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
    libc.mallopt(m_mmap_threshold, 256 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def _steps(request: BenchRequest, workload: BenchWorkload) -> int:
    return (request.warmup + request.repeats) * (2 + (workload.groups is not None))


def megatron_training_step(model: torch.nn.Module, workload: BenchWorkload,
                           config: PrefixSharingConfig) -> Callable[[], None]:
    """One trainer step on ``workload`` (forward, log-probs, policy-gradient loss, backward):
    megatron's stock THD step for ``mode="off"``, the shared step otherwise."""
    from ..megatron_ext import forward_token_stats, prepare_micro_batch
    from ..equivalence import advantages, pg_loss
    from .megatron import stock_thd_batch, stock_thd_token_stats

    groups = workload.groups if config.mode == "prompt_only" else None

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if config.mode == "off":  # megatron's own THD step
            inputs, stats_batch = stock_thd_batch(workload.sequences, backend=config.backend)
            logits = model(inputs.input_ids, inputs.position_ids, None,
                           packed_seq_params=inputs.packed_seq_params)
            stats = stock_thd_token_stats(logits, inputs, stats_batch)
        else:
            batch = prepare_micro_batch(workload.sequences, config, groups=groups)
            stats = forward_token_stats(model, batch)
        weights = advantages(stats.log_probs.numel(), seed=0).to(stats.log_probs.device)
        pg_loss(stats.log_probs, stats.entropy, weights).backward()

    return step


def timed(step: Callable[[], None]) -> float:
    """Wall seconds of ``step()``, device work included."""
    _synchronize()
    start = time.perf_counter()
    step()
    _synchronize()
    return time.perf_counter() - start


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_bytes(step: Callable[[], None]) -> int:
    """The most bytes the step holds allocated at once, above what existed before it.

    On CUDA, the allocator's peak. On CPU, torch keeps no such counter, so the profiler's
    allocation and free events are replayed in time order (op granularity).
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with without_profiler_chatter(), profile(activities=[ProfilerActivity.CPU],
                                             profile_memory=True) as prof:
        step()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


# Lines kineto (the profiler's C++ side) writes straight to file descriptor 2 at every start and
# stop, whatever KINETO_LOG_LEVEL says: "USDT:<date> <pid>:<tid> <file>:<line>] profiler_start".
_PROFILER_CHATTER = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def without_profiler_chatter() -> Iterator[None]:
    """Keeps kineto's start/stop lines out of the user's terminal; everything else written to
    stderr meanwhile (a warning, a crash report) is passed on once the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(True)
                    if not _PROFILER_CHATTER.match(line)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def relative_spread(steps: list[float]) -> float:
    """The spread of one mode's timed steps, (slowest - fastest) / median: how far apart two
    medians of such steps may lie by noise alone (0 for a single step, which shows none)."""
    return (max(steps) - min(steps)) / statistics.median(steps)


def _report(workload: BenchWorkload, request: BenchRequest, configs: dict,
            times: dict[str, list[float]], peaks: dict[str, int]) -> dict:
    plain_s = statistics.median(times["plain"])
    result = {"workload": workload.name, "sequences": len(workload.sequences),
              "plain_ms": plain_s * 1e3, "plain_steps_ms": [t * 1e3 for t in times["plain"]],
              "plain_peak_mb": peaks["plain"] / 2**20}
    for name, config in configs.items():
        if name == "plain":
            continue
        plan_start = time.perf_counter()
        plan = build_plan(workload.sequences, config,
                          groups=workload.groups if name == "prompt_only" else None)
        planner_ms = (time.perf_counter() - plan_start) * 1e3
        shared_s = statistics.median(times[name])
        entry = {
            "tokens_total": plan.num_tokens_total,
            "tokens_unique": plan.num_tokens_unique,
            "token_ratio": plan.token_ratio,
            "flop_ratio": count_flops(plan, request.preset).ratio,
            "shared_ms": shared_s * 1e3,
            "shared_steps_ms": [t * 1e3 for t in times[name]],
            "speedup": plain_s / shared_s,
            "noise": max(relative_spread(times["plain"]), relative_spread(times[name])),
            "shared_peak_mb": peaks[name] / 2**20,
            "memory_ratio": peaks["plain"] / peaks[name],
            "planner_ms": planner_ms,
            **_kv_rows(plan, request),
        }
        entry["speedup_vs_flop_ratio"] = entry["speedup"] / entry["flop_ratio"]
        entry["within_noise"] = abs(entry["speedup"] - 1) <= entry["noise"]
        if name == "shared":
            result.update(entry)
        else:
            result[name] = entry
    return result


def _kv_rows(plan, request: BenchRequest) -> dict:
    """K/V rows one full-attention layer holds for ``plan`` (:func:`~prefix_sharing.attention.
    sources.key_rows`): the shared step's, under the execution its backend gets, and what
    the gather of every segment's keys would hold (the execution before attention over key
    sources); the plain step holds ``tokens_total``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    held = key_rows(plan, backend=resolve_backend(request.config.backend, device, request.dtype))
    return {"kv_execution": held.execution, "kv_rows_per_layer": held.kv_rows,
            "kv_rows_gather": key_rows(plan, execution="gather").kv_rows}


class Progress:
    """A one-line progress bar on stderr (stdout stays clean for ``--json``)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def advance(self, label: str) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] "
                         f"{self.done}/{self.total} {label:<24}")
        sys.stderr.flush()
        self.done += 1

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\r[{'#' * 30}] {self.total}/{self.total} done{' ' * 24}\n")
            sys.stderr.flush()
