#!/usr/bin/env python
"""Where a shared training step's time goes, beside the plain (stock THD) step, on the bench's
micro-batches (Megatron engine, ``--model`` preset - ``small`` by default - CPU, fp32).

For each workload, measured in one process:
- the step's thread CPU time, plain and shared interleaved, medians: unlike wall time it does not
  count the time other processes hold the core, so it stays usable on a loaded machine (caches
  and memory bandwidth are still shared: compare ratios, not absolute figures);
- the fixed cost of a step: the same step on one sequence of ``--fixed-tokens`` tokens (the
  work every step does whatever its tokens: reading every weight, writing every gradient,
  zeroing the embedding's dense gradient, launching the operators of every layer), and what
  the ratio to the FLOP ratio would be without it, ``(plain - fixed) / (shared - fixed)``;
- ``torch.profiler`` of a few steps each: operator launches (and the kinds the shared step
  launches more often than the plain one: its own work), and self time by operator kind (matrix
  products apart; medians over the profiled steps), the heaviest kinds listed.

On a small shape (``tiny-mla``) the fixed cost is much of the step, the same in the plain and
the shared step, and it pulls the speedup below the FLOP ratio whatever sharing does; the second
figure says what sharing does to the work that scales.

    OMP_NUM_THREADS=1 python scripts/profile_step.py [--model small] [--workload tree steprl none]
        [--repeats 9] [--length-scale 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.engines.bench import (BenchWorkload, keep_freed_memory_in_heap,
                                          megatron_training_step, without_profiler_chatter)
from prefix_sharing.flops import count_flops
from prefix_sharing.presets import ModelPreset, get_preset
from prefix_sharing.workloads import make_workload, scale_lengths

MATMULS = ("aten::mm", "aten::bmm", "aten::addmm")
MODES = {"plain": "off", "shared": "arbitrary_prefix"}


def cpu_ms(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median thread CPU milliseconds of each step, timed interleaved after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(repeats + 1):
        for name, step in steps.items():
            start = time.thread_time()
            step()
            if i:
                times[name].append((time.thread_time() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def op_profile(step: Callable[[], None]) -> tuple[dict[str, int], dict[str, float]]:
    """Launches and self milliseconds of one step, by operator kind."""
    from torch.profiler import ProfilerActivity, profile

    with without_profiler_chatter(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts: dict[str, int] = collections.Counter()
    kinds: dict[str, float] = collections.defaultdict(float)
    for event in prof.key_averages():
        counts[event.key] += event.count
        kinds[event.key] += event.self_cpu_time_total / 1e3
    return dict(counts), dict(kinds)


def of_flop_ratio(plain_ms: float, shared_ms: float, fixed_ms: float,
                  flop_ratio: float) -> tuple[float, float]:
    """The speedup ``plain / shared`` as a fraction of ``flop_ratio``, and the same for the part
    of each step above the ``fixed_ms`` both pay whatever their tokens."""
    return (plain_ms / shared_ms / flop_ratio,
            (plain_ms - fixed_ms) / (shared_ms - fixed_ms) / flop_ratio)


def launches(counts: dict[str, int]) -> int:
    """aten operators launched (autograd's own nodes are not counted)."""
    return sum(n for kind, n in counts.items() if kind.startswith("aten::"))


def _median_kinds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per operator kind, the median self time over profiled steps (one preempted op in one
    step does not make a kind look heavy)."""
    return {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in rounds[0]}


def profile_workload(model: torch.nn.Module, preset: ModelPreset, name: str, repeats: int,
                     profiles: int, fixed_ms: float, top: int, length_scale: int = 1) -> dict:
    w = make_workload(name, vocab_size=preset.vocab_size,
                      **scale_lengths(BENCH_SIZES[name], length_scale))
    workload = BenchWorkload(name, w.sequences, None)
    flop_ratio = count_flops(build_plan(w.sequences, PrefixSharingConfig()), preset).ratio
    steps = {m: megatron_training_step(model, workload, PrefixSharingConfig(mode=mode))
             for m, mode in MODES.items()}
    cpu = cpu_ms(steps, repeats)
    rounds = [{m: op_profile(step) for m, step in steps.items()} for _ in range(profiles)]
    profiled = {m: (rounds[0][m][0], _median_kinds([r[m][1] for r in rounds])) for m in steps}
    counts = {m: c for m, (c, _) in profiled.items()}
    more_in_shared = {k: (counts["plain"].get(k, 0), n) for k, n in counts["shared"].items()
                      if k.startswith("aten::") and n > counts["plain"].get(k, 0)}
    self_ms = {m: sum(kinds.values()) for m, (_, kinds) in profiled.items()}
    mm_ms = {m: sum(kinds.get(k, 0.0) for k in MATMULS) for m, (_, kinds) in profiled.items()}
    plain_kinds, shared_kinds = profiled["plain"][1], profiled["shared"][1]
    heaviest = sorted((k for k in shared_kinds if k not in MATMULS),
                      key=lambda k: -shared_kinds[k])[:top]
    cpu_of_flop, without_fixed_of_flop = of_flop_ratio(cpu["plain"], cpu["shared"], fixed_ms,
                                                       flop_ratio)
    return {
        "workload": name, "flop_ratio": flop_ratio, "cpu_ms": cpu,
        "cpu_of_flop": cpu_of_flop, "fixed_ms": fixed_ms,
        "without_fixed_of_flop": without_fixed_of_flop,
        "launches": {m: launches(c) for m, c in counts.items()},
        "launched_more_in_shared": more_in_shared,
        "self_ms": self_ms, "matmul_ms": mm_ms,
        "heaviest_other": {k: (plain_kinds.get(k, 0.0), shared_kinds[k]) for k in heaviest},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a GPT preset (small, tiny-mla, ...)")
    parser.add_argument("--workload", nargs="+", default=["tree", "steprl", "none"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--profiles", type=int, default=3,
                        help="profiled steps per mode (per-kind medians; default: 3)")
    parser.add_argument("--fixed-tokens", type=int, default=16)
    parser.add_argument("--length-scale", type=int, default=1, metavar="K",
                        help="every segment of the workloads K times as long (as bench's)")
    parser.add_argument("--top", type=int, default=8, help="operator kinds listed per workload")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from prefix_sharing.engines.launch import free_port, init_megatron
    from prefix_sharing.engines.megatron import preset_model

    init_megatron(0, 1, free_port())
    keep_freed_memory_in_heap()
    preset = get_preset(args.model)
    model = preset_model(preset, layout="shared", dtype=torch.float32)
    tiny = BenchWorkload("fixed", [torch.arange(1, args.fixed_tokens + 1)], None)
    fixed_step = megatron_training_step(model, tiny, PrefixSharingConfig())
    fixed = cpu_ms({"fixed": fixed_step}, args.repeats)["fixed"]
    fixed_launches = launches(op_profile(fixed_step)[0])
    rows = [profile_workload(model, preset, name, args.repeats, args.profiles, fixed, args.top,
                             args.length_scale)
            for name in args.workload]
    if args.json:
        print(json.dumps({"fixed_ms": fixed, "fixed_launches": fixed_launches, "workloads": rows},
                         indent=1))
        return
    print(f"fixed cost of a step ({args.fixed_tokens} tokens): {fixed:.0f} ms CPU, "
          f"{fixed_launches} operator launches")
    for r in rows:
        cpu, self_ms, mm = r["cpu_ms"], r["self_ms"], r["matmul_ms"]
        print(f"\n{args.model} {r['workload']}: flop x {r['flop_ratio']:.2f}; CPU ms plain {cpu['plain']:.0f} "
              f"shared {cpu['shared']:.0f}: {r['cpu_of_flop']:.3f} of the FLOP ratio "
              f"({r['without_fixed_of_flop']:.3f} without the fixed cost)")
        print(f"  operator launches {r['launches']['plain']} / {r['launches']['shared']}; "
              f"profiled self ms {self_ms['plain']:.0f} / {self_ms['shared']:.0f} "
              f"(x {self_ms['plain'] / self_ms['shared']:.2f}); matrix products "
              f"{mm['plain']:.0f} / {mm['shared']:.0f} (x {mm['plain'] / mm['shared']:.2f}); "
              f"the rest {self_ms['plain'] - mm['plain']:.0f} / "
              f"{self_ms['shared'] - mm['shared']:.0f}")
        for kind, (p, s) in r["heaviest_other"].items():
            print(f"    {kind:<40} {p:8.1f} {s:8.1f} ms")
        more = ", ".join(f"{k} {p}->{s}" for k, (p, s) in r["launched_more_in_shared"].items())
        print(f"  launched more often by the shared step: {more or 'nothing'}")


if __name__ == "__main__":
    main()
