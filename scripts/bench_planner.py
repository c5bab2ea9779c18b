#!/usr/bin/env python
"""Planner speed on full-size micro-batches: 128 sequences x 4096 tokens.

Workloads are timed interleaved (A B A B ...) so that machine noise hits all of them alike;
medians and the 10th-90th percentile are reported. Targets (2-core CPU): GRPO-shaped sharing
(16 prompts x 8 responses) <= 10 ms, nothing shared <= 3 ms.

Minor page faults per plan are reported too: the plan's index arrays are several MB, glibc
returns freed blocks of that size to the kernel, and on a virtual machine each first touch of a
4 KiB page costs microseconds. ``--warm-heap`` keeps freed memory in the heap (glibc
``mallopt``), as a process that allocates such blocks steadily would, to show the planner's own
cost without that effect.

    python scripts/bench_planner.py [--repeats 50] [--warm-heap] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.engines.bench import keep_freed_memory_in_heap
from prefix_sharing.workloads import make_workload

VOCAB = 151_936  # Qwen2.5's vocabulary
SEQ_LEN = 4096

WORKLOADS = {
    # 16 prompts of 1024 tokens, 8 responses of 3072 tokens each
    "grpo": dict(num_prompts=16, group_size=8, prompt_len=(1024, 1024),
                 response_len=(SEQ_LEN - 1024, SEQ_LEN - 1024)),
    # 8 chains of 16 steps: 1024-token prompt, 192-token steps (the last sample is 4096 tokens)
    "steprl": dict(num_chains=8, num_steps=16, prompt_len=(1024, 1024), step_len=(192, 192)),
    # 128 unrelated sequences
    "none": dict(num_sequences=128, seq_len=(SEQ_LEN - 1, SEQ_LEN - 1)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warm-heap", action="store_true",
                        help="keep freed memory in the heap (no page faults on reuse)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the planner is host code; keep torch's pool out of the timing
    if args.warm_heap:
        keep_freed_memory_in_heap()

    batches = {name: make_workload(name, vocab_size=VOCAB, **kw).sequences
               for name, kw in WORKLOADS.items()}
    config = PrefixSharingConfig()
    times: dict[str, list[float]] = {name: [] for name in batches}
    faults: dict[str, int] = {name: 0 for name in batches}
    for _ in range(args.repeats):
        for name, seqs in batches.items():
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            build_plan(seqs, config)
            times[name].append((time.perf_counter() - start) * 1e3)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before

    results = []
    for name, seqs in batches.items():
        plan = build_plan(seqs, config)
        ts = sorted(times[name])
        results.append({
            "workload": name,
            "sequences": len(seqs),
            "tokens_total": plan.num_tokens_total,
            "tokens_unique": plan.num_tokens_unique,
            "median_ms": statistics.median(ts),
            "p10_ms": ts[len(ts) // 10],
            "p90_ms": ts[(9 * len(ts)) // 10],
            "page_faults": faults[name] / args.repeats,
        })
    if args.json:
        print(json.dumps({"repeats": args.repeats, "warm_heap": args.warm_heap, "results": results}))
        return
    print(f"{'workload':<8} {'seqs':>5} {'tokens':>9} {'unique':>9} {'median ms':>10} "
          f"{'p10-p90 ms':>12} {'faults':>7}")
    for r in results:
        print(f"{r['workload']:<8} {r['sequences']:>5} {r['tokens_total']:>9} {r['tokens_unique']:>9} "
              f"{r['median_ms']:>10.2f} {r['p10_ms']:>5.2f}-{r['p90_ms']:<6.2f} {r['page_faults']:>7.0f}")


if __name__ == "__main__":
    main()
