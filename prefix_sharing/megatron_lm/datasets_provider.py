"""Megatron-LM's ``train_valid_test_datasets_provider`` for the two kinds of data.

It is marked ``is_distributed``: Megatron-LM then builds the data loader on every rank, so
every tensor-parallel rank and pipeline stage reads (and plans) the same micro-batch itself.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import PrefixSharingConfig
from .datasets import TrajectoryPacks, sft_dataset

__all__ = ["datasets_provider"]


def datasets_provider(kind: str, config: PrefixSharingConfig) -> Callable:
    """``provider(train_val_test_num_samples) -> (train, None, None)``."""

    def provider(num_samples: list[int]):
        from megatron.training import get_args, get_tokenizer

        args = get_args()
        if kind == "gpt":
            budget = args.prefix_sharing_token_budget or args.seq_length
            train = TrajectoryPacks(args.prefix_sharing_data, budget, config)
        else:
            train = sft_dataset(args.data_path[0], num_samples[0], args.seq_length,
                                get_tokenizer(), args.seed)
        return train, None, None

    provider.is_distributed = True
    return provider
