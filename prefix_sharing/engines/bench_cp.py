"""``bench --cp N``: a training step split over context-parallel ranks, plain CP vs shared CP.

Both steps run the same model through megatron's schedule on ``tp x pp x cp`` ranks with the
prefix-sharing attention's CP (:mod:`~prefix_sharing.megatron_ext.context_parallel`: the flat
rows split over the CP ranks, K/V all-gathered in every attention layer): *plain CP* on the
nothing-shared plan (every token computed, as megatron's own CP computes them), *shared CP* on
the sharing plan. Megatron's stock attention refuses CP, so this is the plain CP there is to
compare with; its ring or all-gather CP moves the same K/V volume.

Reported per workload: the step's median wall time on this rank (steps interleaved, plain,
shared, plain, ..., after a warm-up) and the bytes the CP group's collectives moved per
attention layer on one rank, *counted* by wrapping megatron's all-gather and reduce-scatter
during one step (forward: K/V received from the other ranks; backward: dK/dV sent in the
reduce-scatter), next to :func:`~prefix_sharing.megatron_ext.context_parallel.kv_bytes_per_layer`'s
formula for the same plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import PrefixSharingConfig
from .bench import BenchRequest, BenchWorkload, Progress, keep_freed_memory_in_heap, timed

__all__ = ["context_parallel_bench_job", "CollectiveBytes",
           "counting_collectives", "table"]


@dataclasses.dataclass
class CollectiveBytes:
    """Bytes one rank's all-gathers received from the other ranks and its reduce-scatters sent
    to them, on one process group."""

    gathered: int = 0
    scattered: int = 0


@contextlib.contextmanager
def counting_collectives(group: torch.distributed.ProcessGroup) -> Iterator[CollectiveBytes]:
    """Counts, inside the block, what megatron's all-gather and reduce-scatter (those of its
    sequence-parallel mappings, which the CP attention's K/V gather uses) move on ``group``.

    An all-gather of ``n`` local bytes over ``p`` ranks receives ``(p - 1) n``; a reduce-scatter
    of ``n`` bytes into ``n / p`` sends ``(p - 1) n / p``. Only ``[rows, heads, head_dim]``
    tensors (K, V and their gradients) are counted: collectives on other groups, and the MoE
    router's ``[rows, experts]`` gathers over the same group, pass uncounted.
    """
    from megatron.core.tensor_parallel import mappings

    counted = CollectiveBytes()
    gather, scatter = mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func

    def counted_gather(output: torch.Tensor, input_: torch.Tensor, *args: Any, **kwargs: Any):
        if kwargs.get("group") is group and input_.dim() == 3:
            counted.gathered += (output.numel() - input_.numel()) * output.element_size()
        return gather(output, input_, *args, **kwargs)

    def counted_scatter(output: torch.Tensor, input_: torch.Tensor, *args: Any, **kwargs: Any):
        if kwargs.get("group") is group and input_.dim() == 3:
            counted.scattered += (input_.numel() - output.numel()) * input_.element_size()
        return scatter(output, input_, *args, **kwargs)

    mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = (counted_gather,
                                                                        counted_scatter)
    try:
        yield counted
    finally:
        mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = gather, scatter


def context_parallel_bench_job(rank: int, request: BenchRequest) -> list[dict]:
    """Runs on every rank of ``tp x pp x cp`` (see :mod:`.launch`); one result per workload."""
    from megatron.core import parallel_state

    from .megatron import gpt_model

    if not torch.cuda.is_available():
        keep_freed_memory_in_heap()
    model = gpt_model(request.preset, layout="shared", dtype=request.dtype)
    steps_per_workload = 2 * (request.warmup + request.repeats)
    progress = Progress(steps_per_workload * len(request.workloads),
                        request.progress and torch.distributed.get_rank() == 0)
    group = parallel_state.get_context_parallel_group()
    results = []
    for workload in request.workloads:
        configs = {"plain": dataclasses.replace(request.config, mode="off"),
                   "shared": request.config}
        steps = {name: _training_step(model, workload, cfg) for name, cfg in configs.items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(request.warmup + request.repeats):
            for name, step in steps.items():
                progress.advance(f"{workload.name} {name}")
                torch.distributed.barrier()
                elapsed = timed(step)
                if i >= request.warmup:
                    times[name].append(elapsed)
        counted, rows = {}, {}
        for name, step in steps.items():
            with counting_collectives(group) as counted[name]:
                rows[name] = step()
        results.append(_report(workload, request, model, times, counted, rows))
    progress.close()
    return results


def _training_step(model: torch.nn.Module, workload: BenchWorkload,
                   config: PrefixSharingConfig) -> Callable[[], int]:
    """One trainer step through megatron's schedule (plan, forward, log-probs, policy-gradient
    loss, backward, the CP gradient reduction); returns the plan's flat rows."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..equivalence import advantages, pg_loss
    from ..megatron_ext import prepare_micro_batch, token_stats
    from .megatron import finalize_context_parallel_grads, finalize_sequence_parallel_grads

    def step() -> int:
        model.zero_grad(set_to_none=True)
        batch = prepare_micro_batch(workload.sequences, config)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            output = model(mb.input_ids, mb.position_ids, None,
                           packed_seq_params=mb.packed_seq_params)

            def loss_func(logits):
                stats = token_stats(logits, mb)
                weights = advantages(stats.log_probs.numel(), seed=0).to(stats.log_probs.device)
                return pg_loss(stats.log_probs, stats.entropy, weights), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
            num_microbatches=1, seq_length=max(len(s) for s in workload.sequences),
            micro_batch_size=1,
        )
        finalize_sequence_parallel_grads(model)
        finalize_context_parallel_grads(model)
        return batch.plan.num_tokens_flat

    return step


def _report(workload: BenchWorkload, request: BenchRequest,
            model: torch.nn.Module, times: dict[str, list[float]],
            counted: dict[str, CollectiveBytes], rows: dict[str, int]) -> dict:
    from megatron.core import parallel_state

    from ..megatron_ext.context_parallel import kv_bytes_per_layer

    config = model.config
    cp = parallel_state.get_context_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    kv_heads = max(config.num_query_groups // tp, 1)
    head_dim = config.kv_channels
    layers = len(model.decoder.layers)  # this pipeline stage's attention layers
    dtype_bytes = torch.finfo(request.dtype).bits // 8
    result: dict[str, Any] = {"workload": workload.name, "sequences": len(workload.sequences),
                              "tokens_total": sum(len(s) for s in workload.sequences),
                              "layers_on_this_stage": layers}
    for name in ("plain", "shared"):
        result[name] = {
            "rows": rows[name],
            "ms": statistics.median(times[name]) * 1e3,
            "steps_ms": [t * 1e3 for t in times[name]],
            "gathered_bytes_per_layer": counted[name].gathered / layers,
            "scattered_bytes_per_layer": counted[name].scattered / layers,
            "formula_bytes_per_layer": kv_bytes_per_layer(rows[name], cp, kv_heads, head_dim,
                                                          dtype_bytes),
        }
    plain, shared = result["plain"], result["shared"]
    result["speedup"] = plain["ms"] / shared["ms"]
    result["bytes_ratio"] = plain["gathered_bytes_per_layer"] / shared["gathered_bytes_per_layer"]
    result["formula_matches"] = all(
        r["gathered_bytes_per_layer"] == r["formula_bytes_per_layer"]
        == r["scattered_bytes_per_layer"] for r in (plain, shared))
    return result


def table(results: list[dict]) -> str:
    """The text report: one line per workload."""
    lines = [f"{'workload':<10} {'tokens':>7} {'rows pl':>8} {'rows sh':>8} {'plain ms':>9} "
             f"{'shared ms':>9} {'speedup':>8} {'plain KiB':>10} {'shared KiB':>10} "
             f"{'bytes x':>8} {'formula':>8}"]
    for r in results:
        plain, shared = r["plain"], r["shared"]
        lines.append(
            f"{r['workload']:<10} {r['tokens_total']:>7} {plain['rows']:>8} {shared['rows']:>8} "
            f"{plain['ms']:>9.0f} {shared['ms']:>9.0f} {r['speedup']:>8.2f} "
            f"{plain['gathered_bytes_per_layer'] / 1024:>10.1f} "
            f"{shared['gathered_bytes_per_layer'] / 1024:>10.1f} {r['bytes_ratio']:>8.2f} "
            f"{'ok' if r['formula_matches'] else 'DIFFERS':>8}")
    lines += ["", "rows: the flat layout the CP ranks split (plain CP: every token); ms: median "
              "step time on rank 0; KiB: K/V bytes one rank's all-gathers received per attention "
              "layer in the forward (counted; the backward reduce-scatter sends as much); "
              "formula: counted = kv_bytes_per_layer for the plan, forward and backward"]
    return "\n".join(lines)
