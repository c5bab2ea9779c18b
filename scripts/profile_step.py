#!/usr/bin/env python
"""Where a shared training step's time goes, beside the plain (stock THD) step, on the bench's
micro-batches (Megatron engine, ``small`` preset, CPU, fp32).

For each workload, measured in one process:
- the step's thread CPU time, plain and shared interleaved, medians: unlike wall time it does not
  count the time other processes hold the core, so it stays usable on a loaded machine (caches
  and memory bandwidth are still shared: compare ratios, not absolute figures);
- the fixed cost of a step: the same step on one sequence of ``--fixed-tokens`` tokens (the
  parameter-sized work every step does whatever its tokens: reading every weight twice, writing
  every gradient, zeroing the embedding's dense gradient, ~1,700 operator launches), and what
  the ratio to the FLOP ratio would be without it, ``(plain - fixed) / (shared - fixed)``;
- ``torch.profiler`` of one step each: operator launches, and self time by operator kind
  (matrix products apart), the heaviest kinds listed.

    OMP_NUM_THREADS=1 python scripts/profile_step.py [--workload tree steprl none] [--repeats 9]
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
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import make_workload

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


def op_profile(step: Callable[[], None]) -> tuple[int, dict[str, float]]:
    """Operator launches of one step and self milliseconds by operator kind."""
    from torch.profiler import ProfilerActivity, profile

    with without_profiler_chatter(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    kinds: dict[str, float] = collections.defaultdict(float)
    launches = 0
    for event in prof.key_averages():
        kinds[event.key] += event.self_cpu_time_total / 1e3
        launches += event.count if event.key.startswith("aten::") else 0
    return launches, dict(kinds)


def profile_workload(model: torch.nn.Module, name: str, repeats: int, fixed_ms: float,
                     top: int) -> dict:
    preset = get_preset("small")
    w = make_workload(name, vocab_size=preset.vocab_size, **BENCH_SIZES[name])
    workload = BenchWorkload(name, w.sequences, None)
    flop_ratio = count_flops(build_plan(w.sequences, PrefixSharingConfig()), preset).ratio
    steps = {m: megatron_training_step(model, workload, PrefixSharingConfig(mode=mode))
             for m, mode in MODES.items()}
    cpu = cpu_ms(steps, repeats)
    profiles = {m: op_profile(step) for m, step in steps.items()}
    self_ms = {m: sum(kinds.values()) for m, (_, kinds) in profiles.items()}
    mm_ms = {m: sum(kinds.get(k, 0.0) for k in MATMULS) for m, (_, kinds) in profiles.items()}
    plain_kinds, shared_kinds = profiles["plain"][1], profiles["shared"][1]
    heaviest = sorted((k for k in shared_kinds if k not in MATMULS),
                      key=lambda k: -shared_kinds[k])[:top]
    return {
        "workload": name, "flop_ratio": flop_ratio, "cpu_ms": cpu,
        "cpu_of_flop": cpu["plain"] / cpu["shared"] / flop_ratio,
        "fixed_ms": fixed_ms,
        "without_fixed_of_flop": (cpu["plain"] - fixed_ms) / (cpu["shared"] - fixed_ms) / flop_ratio,
        "launches": {m: p[0] for m, p in profiles.items()},
        "self_ms": self_ms, "matmul_ms": mm_ms,
        "heaviest_other": {k: (plain_kinds.get(k, 0.0), shared_kinds[k]) for k in heaviest},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["tree", "steprl", "none"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--fixed-tokens", type=int, default=16)
    parser.add_argument("--top", type=int, default=8, help="operator kinds listed per workload")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from prefix_sharing.engines.launch import free_port, init_megatron
    from prefix_sharing.engines.megatron import preset_model

    init_megatron(0, 1, free_port())
    keep_freed_memory_in_heap()
    model = preset_model(get_preset("small"), layout="shared", dtype=torch.float32)
    tiny = BenchWorkload("fixed", [torch.arange(1, args.fixed_tokens + 1)], None)
    fixed = cpu_ms({"fixed": megatron_training_step(model, tiny, PrefixSharingConfig())},
                   args.repeats)["fixed"]
    rows = [profile_workload(model, name, args.repeats, fixed, args.top) for name in args.workload]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"fixed cost of a step ({args.fixed_tokens} tokens): {fixed:.0f} ms CPU")
    for r in rows:
        cpu, self_ms, mm = r["cpu_ms"], r["self_ms"], r["matmul_ms"]
        print(f"\n{r['workload']}: flop x {r['flop_ratio']:.2f}; CPU ms plain {cpu['plain']:.0f} "
              f"shared {cpu['shared']:.0f}: {r['cpu_of_flop']:.3f} of the FLOP ratio "
              f"({r['without_fixed_of_flop']:.3f} without the fixed cost)")
        print(f"  operator launches {r['launches']['plain']} / {r['launches']['shared']}; "
              f"profiled self ms {self_ms['plain']:.0f} / {self_ms['shared']:.0f} "
              f"(x {self_ms['plain'] / self_ms['shared']:.2f}); matrix products "
              f"{mm['plain']:.0f} / {mm['shared']:.0f} (x {mm['plain'] / mm['shared']:.2f}); "
              f"the rest {self_ms['plain'] - mm['plain']:.0f} / {self_ms['shared'] - mm['shared']:.0f}")
        for kind, (p, s) in r["heaviest_other"].items():
            print(f"    {kind:<40} {p:8.1f} {s:8.1f}")


if __name__ == "__main__":
    main()
