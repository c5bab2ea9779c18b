"""Batching that keeps what is shared together: micro-batches under a token budget (or of a
fixed sample count), and the batch's partition over data-parallel ranks, both balanced by one
cost model.

- :mod:`.groups`: sharing groups (uid groups, else prefix trees), the unit both move.
- :mod:`.cost`: the cost model (computed tokens plus attention) both balance by.
- :mod:`.micro_batches`: :func:`split_micro_batches` (a token budget) and
  :func:`split_fixed_micro_batches` (a fixed sample count).
- :mod:`.data_parallel`: :func:`partition_data_parallel`.
"""

from .cost import CostModel, computed_cost
from .data_parallel import DataParallelPartition, partition_data_parallel
from .groups import sharing_groups
from .micro_batches import MicroBatchSplit, split_fixed_micro_batches, split_micro_batches

__all__ = [
    "CostModel",
    "DataParallelPartition",
    "MicroBatchSplit",
    "computed_cost",
    "partition_data_parallel",
    "sharing_groups",
    "split_fixed_micro_batches",
    "split_micro_batches",
]
