#!/usr/bin/env python
"""How much of bench's step does not shrink with the computed tokens, measured load-robustly.

``bench`` reports the speedup as a fraction of the FLOP ratio. On a small shape the step also
holds work that does not depend on the tokens - per-op dispatch of every layer and expert,
per-parameter gradient work - and it is the same in the plain and the shared step, so it pulls
the speedup below the FLOP ratio whatever sharing does. This script separates the two: it times
the plain and the shared step (process CPU time with one thread, so that other jobs on the
machine barely move it; medians, interleaved) on bench's ``tree`` micro-batch and on a tree of
the same shape (same sequences and segments) with ~1/30 of its tokens, the fixed cost. The
speedup of the part above the fixed cost is what sharing does to the work that scales.

    OMP_NUM_THREADS=1 python scripts/step_fixed_cost.py --model small-mla [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from prefix_sharing.engines.launch import run_distributed

# the bench's tree, and the same tree with 3-4 token prompts and 1-2 token nodes
FLOOR_TREE = dict(depth=3, branching=2, prompt_len=(3, 4), node_len=(1, 2))


def decompose(ms: dict[str, float], flop_ratio: float) -> dict[str, float]:
    """The speedup, the fixed share of the shared step and the speedup above the fixed cost,
    each also as a fraction of ``flop_ratio``, from the medians ``ms`` of ``tree/plain``,
    ``tree/shared``, ``floor/plain`` and ``floor/shared``."""
    plain, shared = ms["tree/plain"], ms["tree/shared"]
    fixed_plain, fixed_shared = ms["floor/plain"], ms["floor/shared"]
    above = (plain - fixed_plain) / (shared - fixed_shared)
    return {"speedup": plain / shared, "of_flop": plain / shared / flop_ratio,
            "fixed_share_of_shared_step": fixed_shared / shared,
            "speedup_above_fixed": above, "above_fixed_of_flop": above / flop_ratio}


def _job(rank: int, model_name: str, repeats: int) -> tuple[float, dict[str, float]]:
    del rank
    from prefix_sharing.cli.bench import BENCH_SIZES
    from prefix_sharing.config import PrefixSharingConfig
    from prefix_sharing.engines.bench import (BenchWorkload, keep_freed_memory_in_heap,
                                              megatron_training_step)
    from prefix_sharing.engines.megatron import preset_model
    from prefix_sharing.flops import count_flops
    from prefix_sharing.planner import build_plan
    from prefix_sharing.presets import get_preset
    from prefix_sharing.workloads import make_workload

    torch.set_num_threads(1)  # CPU time of one thread: what other jobs' load moves least
    keep_freed_memory_in_heap()
    preset = get_preset(model_name)
    model = preset_model(preset, layout="shared")
    config = PrefixSharingConfig()
    steps, flop_ratio = {}, 0.0
    for name, sizes in (("tree", BENCH_SIZES["tree"]), ("floor", FLOOR_TREE)):
        sequences = make_workload("tree", vocab_size=preset.vocab_size, **sizes).sequences
        if name == "tree":
            flop_ratio = count_flops(build_plan(sequences, config), preset).ratio
        workload = BenchWorkload(name, sequences, None)
        for mode, cfg in (("plain", dataclasses.replace(config, mode="off")),
                          ("shared", config)):
            steps[f"{name}/{mode}"] = megatron_training_step(model, workload, cfg)
    for step in steps.values():  # warm-up
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.process_time()
            step()
            times[name].append(time.process_time() - start)
    return flop_ratio, {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small-mla")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    flop_ratio, ms = run_distributed(_job, 1, args.model, args.repeats, timeout=3600)[0]
    parts = decompose(ms, flop_ratio)
    print(f"{args.model}, tree: CPU ms {', '.join(f'{k} {v:.1f}' for k, v in ms.items())}")
    print(f"speedup {parts['speedup']:.2f} = {parts['of_flop']:.2f} of the FLOP ratio "
          f"{flop_ratio:.2f}; fixed cost {100 * parts['fixed_share_of_shared_step']:.0f}% of the "
          f"shared step; above it {parts['speedup_above_fixed']:.2f} = "
          f"{parts['above_fixed_of_flop']:.2f} of the FLOP ratio")


if __name__ == "__main__":
    main()
