"""The data the sharing entry point trains on, in the packed form its forward step reads.

- ``sft``: Megatron-LM's own ``SFTDataset`` (``megatron/training/datasets/sft_dataset.py``) over a
  JSONL file of ``{"messages": [...]}`` lines, tokenized by Megatron-LM's tokenizer
  (``tokenize_conversation``). Only its low-level reader is replaced - a plain JSON Lines reader
  instead of HuggingFace ``datasets`` - so packing, truncation and the loss mask are Megatron-LM's.
- ``gpt``: a rollout / trajectory file as ``prefix-sharing analyze`` reads it
  (:mod:`prefix_sharing.rollouts`: JSONL or Parquet, ``input_ids`` or ``prompt_ids`` +
  ``response_ids``). The file is split into micro-batches by
  :func:`prefix_sharing.batching.split_micro_batches` - sequences that share a prefix stay in
  one micro-batch, and the budget counts the tokens a micro-batch *computes* - and each
  micro-batch becomes one pack (``--micro-batch-size 1``). The loss covers the responses (with
  ``prompt_ids``), else every predicted token.

The split is made with sharing on even when ``--prefix-sharing-mode off``, so the run with
sharing off sees the very same micro-batches and differs only in computing every token.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..batching import MicroBatchSplit, split_micro_batches
from ..config import PrefixSharingConfig
from ..rollouts import load_rollouts

__all__ = ["TrajectoryPacks", "JsonlConversations", "sft_dataset"]


class TrajectoryPacks(torch.utils.data.Dataset):
    """A rollout file as packs, one per group-keeping micro-batch.

    Each item is a dict of 1-D tensors in Megatron-LM's SFT form: ``tokens``, ``labels`` (the
    next token within each sequence; 0 at a sequence's last token), ``loss_mask``,
    ``position_ids`` (restarting per sequence) and ``cu_seqlens`` (the boundaries, then the pack
    length repeated to ``len + 1`` entries). Indices past the end wrap around (Megatron-LM asks
    for ``train_iters x global_batch_size`` samples).
    """

    def __init__(self, path: str | Path, token_budget: int, config: PrefixSharingConfig) -> None:
        rollouts = load_rollouts(path)
        self.sequences = [s.numpy() for s in rollouts.sequences]
        prompt_lens = [0] * len(self.sequences)
        if rollouts.groups is not None:
            for group in rollouts.groups:
                for i in group.members:
                    prompt_lens[i] = group.prompt_len
        self.prompt_lens = prompt_lens
        split_config = config if config.enabled else dataclasses.replace(
            config, mode="arbitrary_prefix"
        )
        self.split: MicroBatchSplit = split_micro_batches(
            self.sequences, token_budget, split_config
        )

    def __len__(self) -> int:
        return len(self.split.micro_batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        members = self.split.micro_batches[index % len(self)]
        tokens, labels, mask, positions, bounds = [], [], [], [], [0]
        for i in members:
            seq = self.sequences[i]
            n = seq.size
            tokens.append(seq)
            labels.append(np.concatenate([seq[1:], [0]]))
            # the token at t predicts t + 1: score the predictions of response tokens
            scored = np.zeros(n, dtype=np.float32)
            scored[max(self.prompt_lens[i] - 1, 0): n - 1] = 1.0
            mask.append(scored)
            positions.append(np.arange(n))
            bounds.append(bounds[-1] + n)
        total = bounds[-1]
        cu = np.full(total + 1, total, dtype=np.int32)
        cu[: len(bounds)] = bounds
        return {
            "tokens": torch.from_numpy(np.concatenate(tokens).astype(np.int64)),
            "labels": torch.from_numpy(np.concatenate(labels).astype(np.int64)),
            "loss_mask": torch.from_numpy(np.concatenate(mask)),
            "position_ids": torch.from_numpy(np.concatenate(positions).astype(np.int64)),
            "cu_seqlens": torch.from_numpy(cu),
        }


class JsonlConversations:
    """Megatron-LM's SFT low-level dataset (one ``messages`` list per JSONL line), read without
    HuggingFace ``datasets``."""

    def __init__(self, path: str | Path) -> None:
        self.rows: list[list[dict[str, Any]]] = []
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
                    raise ValueError(f"{path}:{number}: expected an object with a 'messages' list")
                self.rows.append(record["messages"])
        if not self.rows:
            raise ValueError(f"{path}: no conversations")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        return self.rows[index]


def sft_dataset(path: str | Path, num_samples: int, seq_length: int, tokenizer: Any,
                seed: int) -> torch.utils.data.Dataset:
    """Megatron-LM's ``SFTDataset`` over a JSONL file of conversations, in file order."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.training.datasets.sft_dataset import SFTDataset

    conversations = JsonlConversations(path)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([str(path)], None),
        split="100,0,0",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        context_parallel_size=1,  # the entry point refuses context parallelism
    )
    indices = np.arange(len(conversations), dtype=np.int64)
    return SFTDataset(conversations, str(path), indices, num_samples, Split.train, config)
