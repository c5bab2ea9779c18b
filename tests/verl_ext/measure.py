"""What sharing saves in verl's real Megatron or FSDP engine on CPU (verl 0.9.1 or 0.8.0): tokens
computed and the wall time of ``forward_backward_batch`` (verl's ``ppo_loss``), feature off vs
``arbitrary_prefix``.

    .venv-verl091/bin/python -m tests.verl_ext.measure --engine megatron --preset small \\
        --prompts 2 --group 8 --prompt-len 256 --response-len 32 64 --repeats 3

One GRPO mini-batch, one rank; verl's contiguous micro-batches of one group each (micro-batch
size = group size). Megatron: the preset's GPTModel injected into verl's engine
(``_engine.build_engine``). FSDP: the preset saved as a Qwen2 checkpoint and loaded by verl's own
``initialize()`` (gradient checkpointing on, FSDP2, fp32), each step in verl's ``train_mode()``.
Time it on a quiet machine; the token counts do not depend on it.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from functools import partial

from prefix_sharing.presets import PRESETS

from ._batch import make_batch, use_cpu_platform

SETTINGS = {"off": None, "arbitrary_prefix": {"mode": "arbitrary_prefix"}}


def measure(rank: int, engine_name: str, checkpoint: str | None, args: argparse.Namespace) -> dict:
    """Median seconds of ``forward_backward_batch`` and the sharing metrics, per setting."""
    preset = PRESETS[args.preset]
    if engine_name == "megatron":  # first: it imports verl's engine the way a CPU rank must
        from ._engine import actor_config, build_engine

        make_engine = partial(build_engine, preset=preset)
    else:
        from ._fsdp_engine import actor_config, build_engine

        make_engine = partial(build_engine, path=checkpoint)
    from verl.workers.utils.losses import ppo_loss

    use_cpu_platform()
    sizes = dict(num_prompts=args.prompts, group_size=args.group,
                 prompt_len=(args.prompt_len, args.prompt_len),
                 response_len=tuple(args.response_len))
    batch = partial(make_batch, "grpo", micro_batch_size=args.group,
                    vocab_size=preset.vocab_size, **sizes)
    out = {}
    for name, block in SETTINGS.items():
        config = actor_config(block)
        engine = make_engine(config)
        step_mode = engine.train_mode if engine_name == "fsdp" else contextlib.nullcontext
        times, result = [], None
        for _ in range(args.repeats + 1):  # the first run warms up
            with step_mode():
                start = time.perf_counter()
                result = engine.forward_backward_batch(batch(), partial(ppo_loss, config=config))
                times.append(time.perf_counter() - start)
        out[name] = dict(seconds=statistics.median(times[1:]),
                         metrics={k: v for k, v in result["metrics"].items()
                                  if k.startswith("prefix_sharing/")})
    return out


def run(args: argparse.Namespace) -> dict:
    """:func:`measure` in one rank of the engine's launcher."""
    if args.engine == "megatron":
        from prefix_sharing.engines.launch import run_distributed

        return run_distributed(measure, 1, "megatron", None, args, timeout=1800)[0]
    from tests.fsdp_compat._launch import run_gloo

    from ._fsdp_engine import save_model

    with tempfile.TemporaryDirectory() as checkpoint:
        save_model(checkpoint, preset=PRESETS[args.preset])
        return run_gloo(measure, 1, "fsdp", checkpoint, args, timeout=1800)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="megatron", choices=("megatron", "fsdp"))
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = run(args)
    off, shared = result["off"]["seconds"], result["arbitrary_prefix"]["seconds"]
    tokens = {k: v[0] for k, v in result["arbitrary_prefix"]["metrics"].items()}
    print(f"tokens: {tokens['prefix_sharing/tokens_total']:.0f} total, "
          f"{tokens['prefix_sharing/tokens_computed']:.0f} computed "
          f"(token_ratio {tokens['prefix_sharing/token_ratio']:.3f})")
    print(f"forward_backward_batch ({args.engine}): off {off:.3f} s, arbitrary_prefix "
          f"{shared:.3f} s ({off / shared:.2f}x)")


if __name__ == "__main__":
    main()
