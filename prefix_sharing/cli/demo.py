"""``prefix-sharing demo``: the main job in one command, on CPU, in a few minutes.

Verifies every built-in workload on the Megatron engine (tiny model, fp32: the shared
forward+backward against megatron's stock spec on padded input, judged against that run in
float64), then benches a smaller copy of each on the ``small`` model, and prints both as one
report.
"""

from __future__ import annotations

import argparse
import time


from ..config import PrefixSharingConfig
from ..engines import get_engine
from ..engines.bench import BenchRequest, BenchWorkload
from ..engines.verify import VerifyRequest
from ..planner import build_plan
from ..presets import get_preset
from ..equivalence import QUANTITIES
from ..workloads import WORKLOADS, make_workload
from .bench import table
from .options import help_text

CONFIG = PrefixSharingConfig(min_prefix_len=4)
# about half the bench's default sizes, so the whole demo stays within a few CPU minutes
DEMO_BENCH_SIZES = {
    "grpo": dict(num_prompts=2, group_size=4, prompt_len=(96, 128), response_len=(32, 64)),
    "steprl": dict(num_chains=2, num_steps=4, prompt_len=(64, 96), step_len=(16, 32)),
    "tree": dict(depth=3, branching=2, prompt_len=(64, 96), node_len=(12, 24)),
    "agent": dict(num_tasks=2, num_turns=3, branching=2, system_len=64, task_len=(8, 16),
                  turn_len=(8, 16)),
    "none": dict(num_sequences=8, seq_len=(96, 128)),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="verify and bench the built-in workloads on CPU (a few minutes)",
        description=help_text(__doc__))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    engine = get_engine("megatron")
    started = time.perf_counter()
    print("prefix-sharing demo: every shared prefix computed once, results unchanged\n", flush=True)

    tiny = get_preset("tiny")
    workloads = {name: make_workload(name, vocab_size=tiny.vocab_size) for name in WORKLOADS}
    request = VerifyRequest([(w.sequences, None) for w in workloads.values()], CONFIG, tiny)
    reports = engine.verify(request)
    print("1. verify: tiny model, fp32, shared vs megatron's stock spec on padded input")
    print(f"{'workload':<8} {'seqs':>4} {'tokens':>6} {'unique':>6}  "
          + "  ".join(f"{q:>9}" for q in QUANTITIES) + "  result")
    for (name, w), report in zip(workloads.items(), reports):
        plan = build_plan(w.sequences, CONFIG)
        print(f"{name:<8} {plan.num_sequences:>4} {plan.num_tokens_total:>6} "
              f"{plan.num_tokens_unique:>6}  "
              + "  ".join(f"{report['max_rel_diff'][q]:>9.1e}" for q in QUANTITIES)
              + ("  ok" if report["passed"] else "  FAILED"))
    print("(largest relative differences from the plain run in float64; a quantity passes "
          "within 2x, grads 3x, the plain fp32 run's own)\n", flush=True)

    small = get_preset("small")
    bench_workloads = [
        BenchWorkload(name, (w := make_workload(name, vocab_size=small.vocab_size, **sizes)).sequences,
                      w.groups)
        for name, sizes in DEMO_BENCH_SIZES.items()
    ]
    results = engine.bench(BenchRequest(bench_workloads, CONFIG, small, repeats=3))
    print("2. bench: small model, CPU, one training step (plan + forward + log-probs + "
          "backward), median of 3")
    print(table(results))
    passed = all(r["passed"] for r in reports)
    print(f"\n{verdict(reports, list(workloads))}; {time.perf_counter() - started:.0f} s")
    return 0 if passed else 1


def verdict(reports: list[dict], names: list[str]) -> str:
    """The demo's last line: what was checked (verify's exactness) and what was only measured
    (bench's times, which pass or fail nothing)."""
    failed = [name for name, r in zip(names, reports) if not r["passed"]]
    checked = (f"verify FAILED on {', '.join(failed)}" if failed else
               f"verify passed: shared == plain within tolerance on all {len(names)} workloads")
    return checked + "; bench measured times only (no verdict: ~ marks a speedup within noise)"
