"""verl's real Megatron engine at ``context_parallel_size=2`` with sharing on gives what verl's
stock engine gives at CP=1, on the same weights.

Two gloo processes form one CP group (``run_distributed(..., cp=2)``): the plan's flat layout
replaces verl's per-sample CP padding and zigzag split, each rank runs its half of the rows, the
core attention gathers K/V, and the log-probs / entropy of the local rows are completed with one
all-reduce in place of verl's CP post-processing. Compared, on every CP rank, with the feature
off at CP=1 (verl's own forward, one process): old log-probs and entropy (``infer_batch``),
verl's ``ppo_loss`` per micro-batch and every gradient (``forward_backward_batch``; the CP ranks'
gradients averaged as megatron's DDP does), on a GRPO and a tree batch. Runs under whichever verl
release the environment holds (0.9.1 and 0.8.0 alike). verl's stock CP path cannot be the
reference: megatron's local attention refuses CP > 1, and TE's needs CUDA.
"""

import pytest

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._engine import run  # noqa: E402

WORKLOADS = ["grpo", "tree"]
SHARED = {"arbitrary_prefix": MODES["arbitrary_prefix"]}  # prompt_only plans differently, same CP path


@pytest.fixture(scope="module")
def reference():
    return run_distributed(run, 1, WORKLOADS, {"off": None}, timeout=400)[0]


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(run, 2, WORKLOADS, SHARED, cp=2, timeout=600)


def test_cp2_sharing_matches_the_stock_engine_at_cp1(cp2, reference):
    for rank, result in enumerate(cp2):
        for workload in WORKLOADS:
            for mode in SHARED:
                same_outputs(result[workload, mode], reference[workload, "off"],
                             f"cp2 rank {rank} {workload} {mode}")


def test_each_cp_rank_runs_half_of_the_shared_flat_layout(cp2):
    """The split really happened: each rank's model saw half the rows the plan computes (a
    rank running the whole layout would also pass the comparison above)."""
    for result in cp2:
        for workload in WORKLOADS:
            for mode in SHARED:
                run_ = result[workload, mode]
                metrics = run_["train"]["metrics"]
                [computed] = metrics["prefix_sharing/tokens_computed"]
                [total] = metrics["prefix_sharing/tokens_total"]
                assert computed < total, f"{workload} {mode}: nothing shared"
                assert run_["rows"] and 2 * sum(run_["rows"]) == computed, (workload, mode)
