"""Test harness: run a function on N gloo ranks with megatron-core model parallelism on CPU.

Every run, even world_size=1, happens in freshly spawned processes, so megatron's global state
(parallel_state groups, the RNG tracker, the CPU redirections of ``enable_cpu_megatron``) never
leaks into the pytest process or from one test into the next.

The functions passed to :func:`run_distributed` must be importable by name from a module (a
test module's top level is fine): the spawned child unpickles them by reference.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

__all__ = ["full_grads", "load_full_state", "run_distributed", "tiny_gpt"]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    seed: int = 1234,
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` spawned gloo ranks; return each rank's result.

    Each rank calls ``enable_cpu_megatron()``, ``initialize_model_parallel(tp, pp)`` and
    ``model_parallel_cuda_manual_seed(seed)`` before ``fn``. Arguments and results travel
    pickled by value, so they must be picklable (CPU tensors are).

    Raises:
        RuntimeError: a rank raised or died; the message holds that rank's traceback.
        TimeoutError: the ranks had not all returned after ``timeout`` seconds (a hang); all
            ranks are killed first.
    """
    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    payload = pickle.dumps((fn, args))
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, tp, pp, seed, payload, results_queue),
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
                raise RuntimeError(
                    f"rank {gone[0]} exited with code {procs[gone[0]].exitcode} without a result"
                ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(results))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f} s; killed"
                ) from None
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{data}")
        results[rank] = pickle.loads(data)
    return results


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    tp: int,
    pp: int,
    seed: int,
    payload: bytes,
    results_queue: Any,
) -> None:
    """Body of one spawned rank: set up gloo + megatron, run the function, report back."""
    try:
        from megatron.core import parallel_state, tensor_parallel

        from prefix_sharing.megatron_ext.cpu_support import enable_cpu_megatron

        # Share the cores between the ranks instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        enable_cpu_megatron()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        fn, args = pickle.loads(payload)
        message = (rank, True, pickle.dumps(fn(rank, *args)))
        # No rank exits (closing its sockets, and rank 0 the TCPStore) while others still
        # communicate. A failed rank skips this; the parent then kills the waiting ones.
        torch.distributed.barrier()
    except BaseException:
        message = (rank, False, traceback.format_exc())
    results_queue.put(message)
    # The process group is left alone on purpose: destroying it waits for peers that may be
    # dead, and the process exits right after this anyway.


def _free_port() -> int:
    """A localhost TCP port that was free a moment ago (for the gloo TCPStore)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_gpt(**overrides: Any) -> tuple[Any, Any]:
    """A tiny fp32 ``(TransformerConfig, GPTModel)`` for this rank's pipeline stage.

    Defaults: 2 layers, hidden 64, 4 heads, ffn 128, vocab 128, RoPE, LayerNorm + GeLU, no
    dropout, the stock local layer spec, untied output layer. ``overrides`` may name any
    TransformerConfig field (e.g. ``gated_linear_unit=True, activation_func=F.silu,
    normalization="RMSNorm"`` for SwiGLU/RMSNorm), any GPTModel argument, or
    ``transformer_layer_spec`` (default: ``get_gpt_layer_local_spec`` matching the config's
    normalization and qk_layernorm). ``variable_seq_lengths=True`` lets pipeline stages pass
    activations whose shape changes from one micro-batch to the next (as prefix sharing's flat
    layout does); megatron then requires ``moe_token_dispatcher_type="alltoall"``. Leave the
    fused-kernel switches (``apply_rope_fusion``, ``persist_layer_norm``, ...) at their False
    defaults: those kernels need CUDA. Call it inside a rank of :func:`run_distributed`.
    """
    import dataclasses
    import inspect

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    model_params = set(inspect.signature(GPTModel.__init__).parameters) - {"self", "config"}
    unknown = set(overrides) - config_fields - model_params
    if unknown:
        raise TypeError(f"tiny_gpt() got unknown overrides {sorted(unknown)}")

    config_kwargs: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
    )
    config_kwargs.update({k: v for k, v in overrides.items() if k in config_fields})
    config = TransformerConfig(**config_kwargs)

    model_kwargs: dict[str, Any] = dict(
        vocab_size=128,
        max_sequence_length=256,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    model_kwargs.update({k: v for k, v in overrides.items() if k in model_params})
    model_kwargs.setdefault(
        "transformer_layer_spec",
        get_gpt_layer_local_spec(
            normalization=config.normalization, qk_layernorm=config.qk_layernorm
        ),
    )
    return config, GPTModel(config=config, **model_kwargs)


def _global_name(model: torch.nn.Module, name: str) -> str:
    """``name`` with a stage-local ``decoder.layers.<i>`` renumbered to the global layer index."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix) :].split(".", 1)
    layer_number = model.decoder.layers[int(local)].layer_number  # 1-based, global
    return f"{prefix}{layer_number - 1}.{rest}"


def load_full_state(model: torch.nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Copy a TP=1, PP=1 model's parameters into this rank's shards of ``model``.

    Names are global (see :func:`full_grads`); a tensor-parallel parameter takes this rank's
    slice the way megatron's CPU initialization slices it (``partition_stride`` chunks, dealt
    round-robin, which keeps SwiGLU's [gate; up] halves aligned).
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = full_state[_global_name(model, name)]
            if getattr(param, "tensor_model_parallel", False):
                dim, stride = param.partition_dim, param.partition_stride
                chunks = full.chunk(tp_size * stride, dim=dim)
                full = torch.cat(chunks[tp_rank::tp_size], dim=dim)
            param.copy_(full)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameter gradients, TP shards gathered to TP=1 shape, under global names.

    Collective over the tensor-parallel group: every TP rank must call it.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "tensor_model_parallel", False):
            dim, stride = param.partition_dim, param.partition_stride
            shards = [torch.empty_like(grad) for _ in range(tp_size)]
            torch.distributed.all_gather(shards, grad, group=group)
            per_shard = [shard.chunk(stride, dim=dim) for shard in shards]
            grad = torch.cat([chunks[s] for s in range(stride) for chunks in per_shard], dim=dim)
        grads[_global_name(model, name)] = grad
    return grads
