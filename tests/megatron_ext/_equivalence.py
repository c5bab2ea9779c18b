"""The micro-batches every Megatron equivalence test runs: all sharing shapes, tiny sizes."""

from __future__ import annotations

import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.engines.megatron import MicroBatchRun, compare, forward_backward
from prefix_sharing.workloads import make_workload

from ._distributed import PRESET

SHARE_EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)

WORKLOADS = {
    "grpo": dict(num_prompts=2, group_size=3),
    "steprl": dict(num_chains=1, num_steps=4),
    "tree": dict(depth=2, branching=2),  # with a duplicated leaf and a strict prefix
    "agent": dict(num_tasks=1, num_turns=2, branching=2, system_len=6, task_len=(2, 4),
                  turn_len=(2, 4)),
    "none": dict(num_sequences=4),
}
# what the equivalence tests run unless they name their workloads
DEFAULT_WORKLOADS = ["grpo", "steprl", "tree", "none"]


def micro_batches(names: list[str] = DEFAULT_WORKLOADS) -> list[list[torch.Tensor]]:
    return [make_workload(n, vocab_size=PRESET.vocab_size, seed=i, **WORKLOADS[n]).sequences
            for i, n in enumerate(names)]


def runs_by_layout(ours: torch.nn.Module, stock: torch.nn.Module, batches: list
                   ) -> tuple[MicroBatchRun, MicroBatchRun, dict[str, dict[str, float]]]:
    """``ours`` run shared and packed (nothing shared), megatron's ``stock`` model run on the
    padded batch: the shared and padded runs, and each pair's largest relative differences."""
    shared = forward_backward(ours, batches, "shared", SHARE_EVERY_PREFIX)
    packed = forward_backward(ours, batches, "packed")
    padded = forward_backward(stock, batches, "padded")
    return shared, padded, {
        "shared_vs_padded": compare(shared, padded).max_rel_diff,
        "shared_vs_packed": compare(shared, packed).max_rel_diff,
        "packed_vs_padded": compare(packed, padded).max_rel_diff,
    }
