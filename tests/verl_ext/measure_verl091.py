"""What sharing saves in verl 0.9.1's Megatron engine on CPU: tokens computed and the wall time
of ``forward_backward_batch`` (verl's ``ppo_loss``), feature off vs ``arbitrary_prefix``.

    python -m tests.verl_ext.measure_verl091 --preset small --prompts 2 --group 8 \\
        --prompt-len 256 --response-len 32 64 --repeats 3

One GRPO mini-batch; verl's contiguous micro-batches of one group each (micro-batch size =
group size). Time it on a quiet machine; the token counts do not depend on it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from prefix_sharing.engines.launch import run_distributed
from prefix_sharing.presets import PRESETS

from ._batch import make_batch, use_cpu_platform
from ._engine import actor_config, build_engine


def measure(rank: int, args: argparse.Namespace) -> dict:
    from verl.workers.utils.losses import ppo_loss

    use_cpu_platform()
    preset = PRESETS[args.preset]
    sizes = dict(num_prompts=args.prompts, group_size=args.group,
                 prompt_len=(args.prompt_len, args.prompt_len), response_len=tuple(args.response_len))
    batch = partial(make_batch, "grpo", micro_batch_size=args.group, vocab_size=preset.vocab_size,
                    **sizes)
    out = {}
    for name, block in (("off", None), ("arbitrary_prefix", {"mode": "arbitrary_prefix"})):
        config = actor_config(block)
        engine = build_engine(config, preset=preset)
        times, result = [], None
        for _ in range(args.repeats + 1):  # the first run warms up
            start = time.perf_counter()
            result = engine.forward_backward_batch(batch(), partial(ppo_loss, config=config))
            times.append(time.perf_counter() - start)
        out[name] = dict(seconds=statistics.median(times[1:]),
                         metrics={k: v for k, v in result["metrics"].items()
                                  if k.startswith("prefix_sharing/")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = run_distributed(measure, 1, args, timeout=1800)[0]
    off, shared = result["off"]["seconds"], result["arbitrary_prefix"]["seconds"]
    tokens = {k: v[0] for k, v in result["arbitrary_prefix"]["metrics"].items()}
    print(f"tokens: {tokens['prefix_sharing/tokens_total']:.0f} total, "
          f"{tokens['prefix_sharing/tokens_computed']:.0f} computed "
          f"(token_ratio {tokens['prefix_sharing/token_ratio']:.3f})")
    print(f"forward_backward_batch: off {off:.3f} s, arbitrary_prefix {shared:.3f} s "
          f"({off / shared:.2f}x)")


if __name__ == "__main__":
    main()
