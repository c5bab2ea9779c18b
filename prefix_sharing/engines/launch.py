"""Runs a function on N ranks with megatron-core's model parallelism set up, on CPU or GPU.

Every rank is a fresh process that shares no state with the caller, so megatron's global state
(parallel groups, the RNG tracker, the CPU redirections) never leaks into it. The ranks are
forked from a *fork server* (``torch.multiprocessing``'s forkserver context): a process started
once per caller that imported torch and megatron-core (:data:`PRELOADED`) and did nothing
else, so a rank starts in a fraction of a second instead of importing them again (~4 s each,
which a test suite of hundreds of launches pays otherwise). As a spawned process would, a rank
runs with the caller's environment and writes to the caller's standard output and error, as
they are at launch (:func:`_rank_main`, :class:`_CallerStdio`). One thing a forked rank
cannot have: importing ``prefix_sharing`` reads its switches (``ENABLE_PREFIX_SHARING``,
``PREFIX_SHARING_*``), and a rank imports it before it sets the caller's environment; so while
the caller sets any of them, the ranks are spawned instead, each importing everything afresh
(:func:`_rank_context`). Without CUDA, ranks talk over gloo and run
:func:`enable_cpu_megatron` first.

The function must be importable by name (a module's top level): the child unpickles it by
reference.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import time
import traceback
import warnings
from multiprocessing import reduction
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from ..errors import InputError, RankKilled

__all__ = ["run_distributed", "init_megatron", "rank_threads", "RankError", "RemoteTraceback"]


class RankError(RuntimeError):
    """A spawned rank failed with a bug (not bad input) or died."""


class RemoteTraceback(Exception):
    """A spawned rank's traceback, chained as the cause of the error raised here."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


# What the fork server imports before it forks any rank: imports only (no CUDA, no process
# group, no environment read that a rank's would change); a module missing here is skipped.
PRELOADED = ("torch", "megatron.core")

# How often a launch is tried when its TCPStore port was taken meanwhile, and the error that
# says so in rank 0's traceback.
PORT_ATTEMPTS = 3
PORT_TAKEN = "EADDRINUSE"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    seed: int = 1234,
    timeout: float = 600.0,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned gloo ranks; return each rank's result.

    Each rank calls ``enable_cpu_megatron()``, ``initialize_model_parallel(tp, pp, cp)`` (with
    ``vpp`` model chunks per pipeline rank: megatron's interleaved schedule) and
    ``model_parallel_cuda_manual_seed(seed)`` before ``fn``. Arguments and results travel
    pickled by value, so they must be picklable (CPU tensors are).

    Raises:
        InputError: a rank found bad input (an :class:`~prefix_sharing.errors.InputError`):
            one line naming the rank and the error; the rank's traceback is its cause.
        RankKilled: a rank was killed by a signal (SIGKILL: most often out of memory).
        RankError: a rank raised anything else, or exited without a result; the message
            holds that rank's traceback.
        TimeoutError: the ranks had not all returned after ``timeout`` seconds (a hang); all
            ranks are killed first.

    A launch whose TCPStore port another process took between :func:`free_port` and rank 0's
    bind is retried on a new port (:data:`PORT_ATTEMPTS` launches in all).
    """
    payload = pickle.dumps((fn, args))
    attempts_left = PORT_ATTEMPTS
    while True:
        attempts_left -= 1
        try:
            return _launch(payload, world_size, free_port(), (tp, pp, cp, vpp), seed, timeout)
        except RankError as error:
            # free_port's port was free when asked, but another process (a second test run, a
            # CI lane beside this one) bound it before rank 0's TCPStore did: ask again.
            if PORT_TAKEN not in str(error) or not attempts_left:
                raise


def _launch(payload: bytes, world_size: int, port: int, sizes: tuple[int, int, int, int | None],
            seed: int, timeout: float) -> list[Any]:
    """One launch of the ranks on ``port`` (see :func:`run_distributed`)."""
    ctx = _rank_context()
    results_queue = ctx.Queue()
    caller = (dict(os.environ), _CallerStdio())
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, sizes, seed, payload, results_queue, caller),
            name=f"megatron-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        results = _collect(procs, results_queue, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    return [results[rank] for rank in range(world_size)]


def _collect(procs: list[Any], results_queue: Any, timeout: float) -> dict[int, Any]:
    """Wait for one message per rank; fail on the first error, a dead rank or the deadline."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        try:
            rank, ok, data = results_queue.get(timeout=0.2)
        except queue.Empty:
            # A rank flushes its message before it exits, so an exited rank with nothing left
            # in the queue died without reporting (a crash, os._exit, a kill).
            gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if gone and results_queue.empty():
                raise _death(gone[0], procs[gone[0]].exitcode) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(results))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f} s; killed"
                ) from None
            continue
        if not ok:
            input_error, message, remote = data
            if input_error:
                raise InputError(f"rank {rank}: {message}") from RemoteTraceback(remote)
            raise RankError(f"rank {rank} failed:\n{remote}")
        results[rank] = pickle.loads(data)
    return results


def _death(rank: int, exitcode: int) -> Exception:
    """The error for a rank that exited without a result: killed by a signal (a negative exit
    code), one line for the user (:class:`RankKilled`); else a bug in it (:class:`RankError`)."""
    if exitcode >= 0:
        return RankError(f"rank {rank} exited with code {exitcode} without a result")
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else "a signal"
    cause = (" - on Linux most often the out-of-memory killer: the run needed more memory than "
             "the machine had; ask for less (fewer or shorter rows, a smaller --model preset or "
             "--length-scale)" if -exitcode == signal.SIGKILL else "")
    return RankKilled(f"rank {rank} was killed by {name}{cause}")


class _CallerStdio:
    """The caller's stdout and stderr file descriptors, sent to the rank with its arguments
    (multiprocessing's ``DupFd``: a rank's own descriptors 1 and 2 are the fork server's);
    a rank receives ``(stdout, stderr)``, descriptors of its own."""

    def __reduce__(self):
        return _received_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _received_stdio(*fds: Any) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


def _rank_context() -> Any:
    """The context the ranks start from: the fork server's (see the module doc), preloading
    :data:`PRELOADED`; spawn while the caller sets a switch that importing ``prefix_sharing``
    reads (so the server, started by a forked launch, never has one)."""
    if any("PREFIX_SHARING" in name for name in os.environ):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def rank_threads(world_size: int) -> int:
    """Intra-op threads of each rank: the cores shared between the ranks instead of
    oversubscribed, at most ``OMP_NUM_THREADS`` when the user set it (a spawned rank would
    otherwise take its share of every core even on a machine others are using)."""
    share = max(1, (os.cpu_count() or 1) // world_size)
    asked = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(asked)) if asked.isdigit() and int(asked) > 0 else share


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    sizes: tuple[int, int, int, int | None],
    seed: int,
    payload: bytes,
    results_queue: Any,
    caller: tuple[dict[str, str], tuple[int, int]],
) -> None:
    """Body of one rank: the caller's environment, stdout and stderr (a forked rank's own are
    the fork server's), gloo + megatron set up, the function run, the result reported back."""
    environment, stdio = caller
    os.environ.clear()
    os.environ.update(environment)
    for target, fd in zip((1, 2), stdio):
        if fd != target:  # a spawned rank gets the caller's descriptors under their numbers
            os.dup2(fd, target)
            os.close(fd)
    # megatron-core announces each optional CUDA package it falls back from, in every rank
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    try:
        torch.set_num_threads(rank_threads(world_size))
        tp, pp, cp, vpp = sizes
        init_megatron(rank, world_size, port, tp=tp, pp=pp, cp=cp, vpp=vpp, seed=seed)
        fn, args = pickle.loads(payload)
        message = (rank, True, pickle.dumps(fn(rank, *args)))
        # No rank exits (closing its sockets, and rank 0 the TCPStore) while others still
        # communicate. A failed rank skips this; the parent then kills the waiting ones.
        torch.distributed.barrier()
    except BaseException as error:
        failure = (isinstance(error, InputError), str(error), traceback.format_exc())
        message = (rank, False, failure)
    results_queue.put(message)
    # The process group is left alone on purpose: destroying it waits for peers that may be
    # dead, and the process exits right after this anyway.


def init_megatron(rank: int, world_size: int, port: int, *, tp: int = 1, pp: int = 1,
                  cp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """Process group (NCCL on CUDA, else gloo + :func:`enable_cpu_megatron`) and megatron's
    model-parallel state and RNG tracker, for this rank."""
    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=world_size,
    )
    if not cuda:
        from ..megatron_ext.cpu_support import enable_cpu_megatron

        enable_cpu_megatron()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, virtual_pipeline_model_parallel_size=vpp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (for the TCPStore)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
