#!/usr/bin/env python
"""How much a sliding window trims the K/V gather, on the bench's built-in micro-batches.

For each workload: the tokens, the computed ones, the K/V rows a full-attention layer gathers
(every reuser reads its whole prefix) and the rows a windowed layer gathers once each reuser's
gather is trimmed to the keys its window reaches (``attention.window.windowed_keys``), and the
FLOP ratio of the ``tiny-window`` preset against the same shape without windows.

    python scripts/window_gather.py [--windows 16 128] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.attention.window import windowed_keys
from prefix_sharing.cli.bench import BENCH_SIZES
from prefix_sharing.flops import count_flops
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import WORKLOADS, make_workload


def measure(windows: list[int]) -> list[dict]:
    model = get_preset("tiny-window")
    unwindowed = dataclasses.replace(model, window_size=None)
    rows = []
    for name in WORKLOADS:
        w = make_workload(name, vocab_size=model.vocab_size, **BENCH_SIZES[name])
        plan = build_plan(w.sequences, PrefixSharingConfig())
        # no sharing: no gather at all
        gathered = {str(n): windowed_keys(plan, n).cu_seqlens_kv_host[-1] if plan.has_sharing
                    else 0 for n in windows}
        rows.append(dict(
            workload=name, tokens=plan.num_tokens_total, computed=plan.num_tokens_unique,
            gathered_full=plan.cu_seqlens_kv_host[-1] if plan.has_sharing else 0,
            gathered_window=gathered, flop_ratio=count_flops(plan, model).ratio,
            flop_ratio_no_window=count_flops(plan, unwindowed).ratio,
        ))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.windows)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    names = " ".join(f"{'w=' + str(n):>7}" for n in args.windows)
    print(f"{'workload':<9} {'tokens':>7} {'computed':>8} {'full':>7} {names} "
          f"{'flop x':>7} {'no-win x':>8}")
    for r in rows:
        cells = " ".join(f"{r['gathered_window'][str(n)]:>7}" for n in args.windows)
        print(f"{r['workload']:<9} {r['tokens']:>7} {r['computed']:>8} {r['gathered_full']:>7} "
              f"{cells} {r['flop_ratio']:>7.2f} {r['flop_ratio_no_window']:>8.2f}")


if __name__ == "__main__":
    main()
