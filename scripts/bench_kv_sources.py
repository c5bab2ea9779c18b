#!/usr/bin/env python
"""One attention layer's forward + backward on the bench's micro-batches: key sources in place
against the gather they replace (issue 39).

For each built-in workload at the bench's sizes (``prefix-sharing bench``'s ``BENCH_SIZES``,
times ``--length-scale``), planned with the default config: random q/k/v of the ``small``
preset's attention (8 query heads, 2 K/V heads of 64, fp32) on the plan's flat rows, then
``prefix_attention(..., execution=E)`` forward and backward for ``E`` = ``gather`` (the
execution before) and the one chosen (``sources`` where a segment reads a prefix). Reported:
the K/V rows one layer holds (``attention.sources.key_rows``), the peak bytes above the inputs
(the bench's :func:`~prefix_sharing.engines.bench.peak_memory_bytes`: allocator events replayed
on CPU) and the median wall time of ``--repeats`` steps, interleaved.

    python scripts/bench_kv_sources.py [--length-scale 2] [--repeats 5] [--window W] [--json]

``--window W``: a sliding window of ``W`` keys on the layer (gpt-oss's 128, say): the gather is
then trimmed to each segment's window (:mod:`prefix_sharing.attention.window`), and over
sources each reader row reads a node from its first key in the window on.

``--context-parallel 2 4`` instead counts, for each CP size, the K/V rows the most loaded CP
rank holds per layer (host plans only, nothing timed): the all-gathered flat rows plus, under
the gather, each local query piece's keys copied together; over sources (the torch and NPU
kernels) the flat rows alone, and the query rows the node parts copy.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention import prefix_attention
from prefix_sharing.attention.sources import key_rows
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.engines.bench import keep_freed_memory_in_heap, peak_memory_bytes, timed
from prefix_sharing.workloads import make_workload, scale_lengths

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # the "small" preset's attention
WORKLOADS = ("grpo", "agent", "tree", "none")


def measure(name: str, scale: int, repeats: int, window: int | None = None) -> dict:
    workload = make_workload(name, **scale_lengths(BENCH_SIZES[name], scale))
    plan = build_plan(workload.sequences, PrefixSharingConfig())
    g = torch.Generator().manual_seed(0)
    rows = plan.num_tokens_flat
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k, v = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, requires_grad=True)
            for _ in range(2))
    grad = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    chosen = key_rows(plan, window=window).execution
    executions = {"gather": "gather", "after": chosen}

    def step(execution: str) -> None:
        out = prefix_attention(q, k, v, plan, window=window, execution=execution)
        torch.autograd.grad(out, (q, k, v), grad)

    for execution in executions.values():
        step(execution)  # warm-up
    times = {label: [] for label in executions}
    for _ in range(repeats):
        for label, execution in executions.items():
            times[label].append(timed(lambda e=execution: step(e)))
    result = {"workload": name, "tokens": plan.num_tokens_total, "computed": rows,
              "execution": chosen, "window": window,
              "kv_rows_gather": key_rows(plan, window=window, execution="gather").kv_rows,
              "kv_rows_after": key_rows(plan, window=window).kv_rows}
    for label, execution in executions.items():
        result[f"peak_mb_{label}"] = peak_memory_bytes(lambda e=execution: step(e)) / 2**20
        result[f"ms_{label}"] = statistics.median(times[label]) * 1e3
    return result


def context_parallel_rows(name: str, scale: int, cp: int) -> dict:
    """K/V rows per layer on the CP rank that holds most, under the gather and over sources."""
    from prefix_sharing.attention.sources import source_layout
    from prefix_sharing.megatron_ext.context_parallel import slice_plan

    workload = make_workload(name, **scale_lengths(BENCH_SIZES[name], scale))
    plan = build_plan(workload.sequences, PrefixSharingConfig(), pad_to_multiple_of=cp)
    rows, per_rank = plan.num_tokens_flat, plan.num_tokens_flat // cp
    gathered = [slice_plan(plan, rank, cp).cu_seqlens_kv_host[-1] for rank in range(cp)]
    layouts = [source_layout(plan, rows=(rank * per_rank, (rank + 1) * per_rank))
               for rank in range(cp)]
    copied = [sum(part.cu_seqlens_q_host[-1] for part in layout.parts
                  if part.q_index is not None) for layout in layouts]
    return {"workload": name, "cp": cp, "tokens": plan.num_tokens_total, "computed": rows,
            "kv_rows_gather": rows + max(gathered), "kv_rows_sources": rows,
            "query_rows_copied": max(copied)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length-scale", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--context-parallel", type=int, nargs="+", metavar="CP")
    parser.add_argument("--window", type=int, metavar="W",
                        help="a sliding window of W keys on the layer")
    args = parser.parse_args()
    if args.context_parallel:
        rows = [context_parallel_rows(name, args.length_scale, cp)
                for name in WORKLOADS for cp in args.context_parallel]
        if args.json:
            print(json.dumps(rows))
            return
        print(f"{'workload':<8} {'CP':>2} {'tokens':>7} {'computed':>8} {'kv gather':>9} "
              f"{'kv sources':>10} {'q rows copied':>13}")
        for r in rows:
            print(f"{r['workload']:<8} {r['cp']:>2} {r['tokens']:>7} {r['computed']:>8} "
                  f"{r['kv_rows_gather']:>9} {r['kv_rows_sources']:>10} "
                  f"{r['query_rows_copied']:>13}")
        return
    torch.set_num_threads(1)
    keep_freed_memory_in_heap()
    results = [measure(name, args.length_scale, args.repeats, args.window)
               for name in WORKLOADS]
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'workload':<8} {'tokens':>7} {'computed':>8} {'execution':>9} {'kv gather':>9} "
          f"{'kv after':>8} {'peak MB gather':>14} {'peak MB after':>13} {'ms gather':>9} "
          f"{'ms after':>8}")
    for r in results:
        print(f"{r['workload']:<8} {r['tokens']:>7} {r['computed']:>8} {r['execution']:>9} "
              f"{r['kv_rows_gather']:>9} {r['kv_rows_after']:>8} {r['peak_mb_gather']:>14.1f} "
              f"{r['peak_mb_after']:>13.1f} {r['ms_gather']:>9.1f} {r['ms_after']:>8.1f}")


if __name__ == "__main__":
    main()
