"""What sharing saves in verl's FSDP engine on CPU (0.9.1 or 0.8.0): tokens computed and the
wall time of ``forward_backward_batch`` (verl's ``ppo_loss``), feature off vs
``arbitrary_prefix``.

    python -m tests.verl_ext.measure_fsdp --preset small --prompts 2 --group 8 \\
        --prompt-len 256 --response-len 32 64 --repeats 3

One GRPO mini-batch, one rank; verl's contiguous micro-batches of one group each (micro-batch
size = group size); the model loaded by verl's own ``initialize()`` (gradient checkpointing on,
FSDP2, fp32). Time it on a quiet machine; the token counts do not depend on it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial

from prefix_sharing.presets import PRESETS
from tests.fsdp_compat._launch import run_gloo

from ._batch import make_batch, use_cpu_platform
from ._fsdp_engine import actor_config, build_engine, save_model


def measure(rank: int, path: str, args: argparse.Namespace) -> dict:
    from verl.workers.utils.losses import ppo_loss

    use_cpu_platform()
    sizes = dict(num_prompts=args.prompts, group_size=args.group,
                 prompt_len=(args.prompt_len, args.prompt_len), response_len=tuple(args.response_len))
    batch = partial(make_batch, "grpo", micro_batch_size=args.group,
                    vocab_size=PRESETS[args.preset].vocab_size, **sizes)
    out = {}
    for name, block in (("off", None), ("arbitrary_prefix", {"mode": "arbitrary_prefix"})):
        config = actor_config(block)
        engine = build_engine(config, path)
        times, result = [], None
        for _ in range(args.repeats + 1):  # the first run warms up
            with engine.train_mode():
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
    with tempfile.TemporaryDirectory() as path:
        save_model(path, preset=PRESETS[args.preset])
        result = run_gloo(measure, 1, path, args, timeout=1800)[0]
    off, shared = result["off"]["seconds"], result["arbitrary_prefix"]["seconds"]
    tokens = {k: v[0] for k, v in result["arbitrary_prefix"]["metrics"].items()}
    print(f"tokens: {tokens['prefix_sharing/tokens_total']:.0f} total, "
          f"{tokens['prefix_sharing/tokens_computed']:.0f} computed "
          f"(token_ratio {tokens['prefix_sharing/token_ratio']:.3f})")
    print(f"forward_backward_batch: off {off:.3f} s, arbitrary_prefix {shared:.3f} s "
          f"({off / shared:.2f}x)")


if __name__ == "__main__":
    main()
