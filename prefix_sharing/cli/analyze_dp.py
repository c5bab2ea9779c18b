"""``prefix-sharing analyze FILE --dp N``: what each data-parallel rank would compute.

verl's trainer deals the batch to its data-parallel ranks before any plan is built, and a
rank computes only what its own samples share. Three rows, each the tokens computed per
rank (its part of each group planned alone, the unit the ideal is counted in:
:func:`prefix_sharing.batching.data_parallel.rank_measures`) and the batch's tokens over
their sum:

- ``verl_stock``: verl's own balancing, as its trainer's ``_balance_batch`` calls it
  (``get_seqlen_balanced_partitions(calculate_workload(seq_lens), k_partitions=N,
  equal_size=True)``) - verl's functions, so this row needs verl installed; without it the
  row says so (``verl_stock_unavailable``).
- ``sharing_aware``: :func:`prefix_sharing.batching.partition_data_parallel` (groups: the
  file's uids, or its identical prompts, else the prefix trees).
- ``ideal``: every sharing group whole on one rank, each computed alone.

Each row also gives ``cost_imbalance`` (the costliest rank over the mean, by
:func:`prefix_sharing.batching.computed_cost`) and ``groups_split`` (groups on several ranks).
The rank plans share by token ids alone: recorded routes (``routed_experts``) and image hashes
(``image_hashes``) are not applied to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..batching import partition_data_parallel, sharing_groups
from ..batching.cost import SubsetMeasure
from ..batching.data_parallel import rank_measures
from ..config import PrefixSharingConfig
from ..errors import InputError
from ..rollouts import Rollouts

__all__ = ["data_parallel_report", "data_parallel_text"]

VERL_MISSING = "needs verl installed (pip install verl): it is verl's own partition function"


def data_parallel_report(rollouts: Rollouts, config: PrefixSharingConfig,
                         dp_size: int) -> dict[str, Any]:
    """The ``data_parallel`` object of the JSON report (see the module doc)."""
    sequences, n = rollouts.sequences, len(rollouts.sequences)
    if dp_size < 1:
        raise InputError(f"--dp must be >= 1; got {dp_size}")
    if n % dp_size:
        raise InputError(f"--dp {dp_size}: {n} rollouts do not divide over {dp_size} ranks "
                         "(verl pads the batch to a multiple of the DP size first); use a --dp "
                         f"that divides {n}")
    uids, prompt_lens = _uids_and_prompt_lens(rollouts)
    measure = SubsetMeasure(sequences, config, uids, prompt_lens)
    groups = sharing_groups(sequences, config, uids)
    ours = partition_data_parallel(sequences, dp_size, config, uids=uids,
                                   prompt_lens=prompt_lens)
    total = sum(ours.tokens_total)
    report: dict[str, Any] = {"dp_size": dp_size}
    stock = _verl_stock_partitions([len(s) for s in sequences], dp_size)
    if stock is None:
        report["verl_stock"], report["verl_stock_unavailable"] = None, VERL_MISSING
    else:
        report["verl_stock"] = _row(stock, measure, groups, total)
    report["sharing_aware"] = _row(ours.partitions, measure, groups, total)
    report["ideal"] = {"tokens_computed": ours.ideal_tokens_computed,
                       "token_ratio": total / ours.ideal_tokens_computed}
    return report


def data_parallel_text(report: dict[str, Any]) -> list[str]:
    """The report's lines: a row per balancing, then the tokens each rank computes."""
    lines = [f"data-parallel ranks: {report['dp_size']} (tokens computed per rank)"]
    for key, label in (("verl_stock", "verl stock balancing"), ("sharing_aware", "sharing-aware")):
        row = report[key]
        if row is None:
            lines.append(f"  {label:<22}{report['verl_stock_unavailable']}")
            continue
        lines.append(f"  {label:<22}token ratio {row['token_ratio']:.2f}, cost max/mean "
                     f"{row['cost_imbalance']:.3f}, groups split {row['groups_split']}")
        lines.append("    " + " ".join(map(str, row["tokens_computed"])))
    ideal = report["ideal"]
    lines.append(f"  {'ideal':<22}token ratio {ideal['token_ratio']:.2f} "
                 f"({ideal['tokens_computed']} tokens: each group whole on one rank)")
    return lines


def _uids_and_prompt_lens(rollouts: Rollouts) -> tuple[list[int] | None, list[int] | None]:
    """One uid per row (its prompt group's index) and its prompt length, when the file says
    where prompts end; else None (the groups are then the prefix trees)."""
    if rollouts.groups is None:
        return None, None
    uids, prompt_lens = [0] * len(rollouts.sequences), [0] * len(rollouts.sequences)
    for g, group in enumerate(rollouts.groups):
        for i in group.members:
            uids[i], prompt_lens[i] = g, group.prompt_len
    return uids, prompt_lens


def _verl_stock_partitions(seq_lens: list[int], dp_size: int) -> list[list[int]] | None:
    """verl's trainer balancing of these lengths, or None without verl."""
    try:
        from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions
    except ImportError:
        return None
    workloads = calculate_workload(torch.tensor(seq_lens, dtype=torch.int64))
    return get_seqlen_balanced_partitions(workloads, k_partitions=dp_size, equal_size=True)


def _row(partitions: Sequence[Sequence[int]], measure: SubsetMeasure,
         groups: list[list[int]], total: int) -> dict[str, Any]:
    figures = rank_measures(partitions, groups, measure)
    computed = [f.tokens for f in figures]
    costs = [f.cost for f in figures]
    rank_of = {i: r for r, p in enumerate(partitions) for i in p}
    return {
        "tokens_computed": computed,
        "token_ratio": total / sum(computed),
        "cost_imbalance": max(costs) * len(costs) / sum(costs),
        "groups_split": sum(len({rank_of[i] for i in g}) > 1 for g in groups),
    }
