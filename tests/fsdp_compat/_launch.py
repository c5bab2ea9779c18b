"""Spawns gloo ranks for the FSDP2 tests.

``prefix_sharing.engines.launch.run_distributed`` sets up megatron in every rank, and megatron's
CPU redirections replace ``torch.cuda`` names that transformers' import then trips over; these
ranks get a plain gloo process group and nothing else.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from prefix_sharing.engines.launch import free_port


def run_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> list:
    """``fn(rank, *args)`` on ``world_size`` spawned gloo ranks; each rank's (picklable) result.

    A rank's exception is re-raised here with its traceback (``mp.ProcessRaisedException``).
    """
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(_rank_main, args=(world_size, free_port(), fn, args, out),
                                     nprocs=world_size, join=False, start_method="spawn")
        for _ in range(int(timeout)):
            if context.join(timeout=1):
                break
        else:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the {world_size} ranks did not finish within {timeout:.0f} s")
        return [torch.load(os.path.join(out, f"{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
               out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, *args), os.path.join(out, f"{rank}.pt"))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
