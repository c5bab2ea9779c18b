"""What sharing saves in verl's real Megatron or FSDP engine on CPU (verl 0.9.1 or 0.8.0): tokens
computed and the wall time of ``forward_backward_batch`` (verl's ``ppo_loss``), feature off vs
``arbitrary_prefix`` (and, with ``--cross-micro-batch``, groups across micro-batches).

    .venv-verl091/bin/python -m tests.verl_ext.measure --engine megatron --preset small \\
        --prompts 2 --group 8 --prompt-len 256 --response-len 32 64 --repeats 3

One GRPO mini-batch, one rank; verl's contiguous micro-batches of one group each (micro-batch
size = group size), or with ``--token-budget N`` verl's dynamic batch size under N tokens per
micro-batch (``max_token_len_per_gpu``). Megatron: the preset's GPTModel injected into verl's
engine (``_engine.build_engine``). FSDP: the preset saved as a Qwen2 checkpoint and loaded by
verl's own ``initialize()`` (gradient checkpointing on, FSDP2, fp32), each step in verl's
``train_mode()``. Every setting's engine is built first, then the steps run interleaved (off,
shared, ..., off, shared, ...) after one warm-up round; medians. Time it on a quiet machine; the
token counts do not depend on it.
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
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    use_cpu_platform()
    sizes = dict(num_prompts=args.prompts, group_size=args.group,
                 prompt_len=(args.prompt_len, args.prompt_len),
                 response_len=tuple(args.response_len))
    def batch():
        data = make_batch("grpo", micro_batch_size=args.group, vocab_size=preset.vocab_size,
                          **sizes)
        if args.token_budget is not None:
            tu.assign_non_tensor(data, use_dynamic_bsz=True,
                                 max_token_len_per_gpu=args.token_budget)
        return data

    settings = dict(SETTINGS)
    if args.cross_micro_batch:
        settings["cross_micro_batch"] = {"mode": "arbitrary_prefix", "cross_micro_batch": True}
    engines = {}
    for name, block in settings.items():
        config = actor_config(block)
        engines[name] = config, make_engine(config)
    times = {name: [] for name in settings}
    results = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, (config, engine) in engines.items():
            step_mode = engine.train_mode if engine_name == "fsdp" else contextlib.nullcontext
            with step_mode():
                start = time.perf_counter()
                results[name] = engine.forward_backward_batch(batch(),
                                                              partial(ppo_loss, config=config))
                times[name].append(time.perf_counter() - start)
    return {name: dict(seconds=statistics.median(times[name][1:]),
                       metrics={k: v for k, v in results[name]["metrics"].items()
                                if k.startswith("prefix_sharing/")})
            for name in settings}


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
    parser.add_argument("--token-budget", type=int, default=None,
                        help="verl's dynamic batch size under this many tokens per micro-batch")
    parser.add_argument("--cross-micro-batch", action="store_true",
                        help="also time groups across micro-batches (needs --token-budget)")
    args = parser.parse_args()
    if args.cross_micro_batch and args.token_budget is None:
        parser.error("--cross-micro-batch needs --token-budget")
    result = run(args)
    off = result["off"]["seconds"]
    for name, found in result.items():
        if name == "off":
            continue
        tokens = {k: v[0] for k, v in found["metrics"].items()}
        print(f"{name}: tokens {tokens['prefix_sharing/tokens_total']:.0f} total, "
              f"{tokens['prefix_sharing/tokens_computed']:.0f} computed "
              f"(token_ratio {tokens['prefix_sharing/token_ratio']:.3f}), "
              f"{tokens['prefix_sharing/num_micro_batches']:.0f} micro-batches")
        print(f"  forward_backward_batch ({args.engine}): off {off:.3f} s, {name} "
              f"{found['seconds']:.3f} s ({off / found['seconds']:.2f}x)")


if __name__ == "__main__":
    main()
