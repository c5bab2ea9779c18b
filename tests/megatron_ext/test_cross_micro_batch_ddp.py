"""The group driver under megatron-core's ``DistributedDataParallel``, with and without
overlapped gradient reduction.

A group runs inside the model's ``no_sync_func`` with no ``finalize_model_grads_func``
(:func:`~prefix_sharing.megatron_ext.cross_micro_batch.forward_backward_group`): its
gradients accumulate into DDP's buffers and the caller reduces them once, after its last group,
as megatron's schedule does after a step's last micro-batch. With ``overlap_grad_reduce`` the
bucket hooks never mark a parameter ready inside ``no_sync``, so the reduction runs in
``finalize_model_grads``. Two data-parallel ranks (gloo), each its own GRPO group under a budget
of 84 (a one-level schedule: the prompt kept and read by 4 suffix micro-batches), three steps:
after each step's ``finalize_model_grads``, every rank's ``main_grad`` is the average over the
ranks of the group driver's gradients without DDP (within 1e-5), with and without overlap; the
control that skips the reduction leaves each rank its own.
"""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.equivalence import max_rel_diff

from ._distributed import run_distributed, tiny_gpt
from .test_cross_micro_batch_pipeline import BUDGET, CONFIG, _group

STEPS = 3


def _loss(log_probs: torch.Tensor, entropy: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return -(log_probs * (1 + positions % 3)).sum() + 0.1 * entropy.sum()


def _job(rank: int) -> dict:
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    from prefix_sharing.cross_micro_batch import plan_group
    from prefix_sharing.megatron_ext.cross_micro_batch import forward_backward_group

    schedule = plan_group(_group(seed=5 + rank), BUDGET, CONFIG)
    model = tiny_gpt("shared")
    forward_backward_group(model, schedule, _loss, backend="torch")
    average = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad)
        average[name] = grad / torch.distributed.get_world_size()

    report = {"average": average, "suffixes": len(schedule.suffixes)}
    for run, overlap in (("sync", False), ("overlap", True), ("unreduced", True)):
        model = tiny_gpt("shared")
        ddp = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(overlap_grad_reduce=overlap), model)
        model.config.no_sync_func = ddp.no_sync
        steps = []
        for _ in range(STEPS):
            ddp.zero_grad_buffer()
            forward_backward_group(ddp, schedule, _loss, backend="torch")
            if run != "unreduced":
                finalize_model_grads([ddp])
            steps.append({name: p.main_grad.clone() for name, p in model.named_parameters()})
        report[run] = steps
    return report


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_job, 2, timeout=600)


@pytest.mark.parametrize("run", ["sync", "overlap"])
def test_every_step_reduces_the_groups_gradients_over_data_parallel_ranks(ranks, run):
    assert all(rank["suffixes"] > 1 for rank in ranks)  # each group across micro-batches
    for rank in ranks:
        for step in rank[run]:
            for name, grad in step.items():
                assert max_rel_diff(grad, rank["average"][name]) <= 1e-5, (run, name)


def test_the_control_without_the_reduction_keeps_each_ranks_own_gradients(ranks):
    first, second = (rank["unreduced"][-1] for rank in ranks)
    assert max(max_rel_diff(first[name], second[name]) for name in first) > 1e-2
