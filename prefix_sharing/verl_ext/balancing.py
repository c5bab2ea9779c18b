"""verl's data-parallel balancing, replaced while sharing is on by one that keeps groups whole.

Before any engine sees a step's batch, verl's trainer reorders it so that its dispatch, which
deals the batch to the data-parallel ranks in equal contiguous chunks, gives each rank a
similar load (``_balance_batch``):

- the v1 trainer (verl 0.9's default, ``verl/trainer/ppo/v1/trainer_base.py``; batch in
  TransferQueue as a ``KVBatchMeta``) pads the batch with synthetic samples to a multiple of
  the data-parallel size and the PPO mini-batch (``upsample_batch_to_divisible_size``), then
  balances by each sample's ``seq_len`` tag alone: a GRPO group's responses land on different
  ranks, and each rank computes the prompt again. It runs whatever ``trainer.balance_batch``
  says (verl 0.9.1 reads that flag only in the legacy trainer);
- the legacy trainer (verl 0.8.0's, 0.9's ``use_v1: false``, ``ray_trainer.py``; a padded
  ``DataProto``), when ``trainer.balance_batch`` is on: with ``use_prefix_grouper`` it keeps
  uid groups whole but balances by total tokens and raises unless the group count divides by
  the data-parallel size.

With the actor's ``prefix_grouper`` enabled (read from the trainer's config in the driver,
validated by :meth:`PrefixSharingConfig.from_verl`; the reference model shares the actor's
setting) and ``trainer.balance_batch`` on, both become
:func:`prefix_sharing.batching.partition_data_parallel`: sharing groups whole on one rank,
ranks balanced by computed cost, equal sample counts (verl's dispatch needs them), each rank's
mini-batches (``ppo_mini_batch_size x rollout.n / dp``, unless ``actor.shuffle`` reshuffles
them) holding whole groups where an order allows, the v1 trainer's synthetic samples as
padding. verl's ``global_seqlen/*`` figures are still logged, beside the partition's
``prefix_sharing/dp_*`` ones (:func:`balance_metrics`). Otherwise verl's own function runs,
untouched. With ``ENABLE_PREFIX_SHARING=0`` none of this is applied
(:func:`.switched_off.stock_balancing` instead).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from types import ModuleType
from typing import Any

from ..batching import DataParallelPartition, partition_data_parallel
from ..config import PrefixSharingConfig

__all__ = ["LEGACY_TRAINER_MODULE", "V1_TRAINER_MODULE", "balance_metrics", "balancing_hooks",
           "mini_batch_size_per_rank", "partition_batch", "patch_legacy_balancing",
           "patch_v1_balancing", "trainer_sharing"]

LEGACY_TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
V1_TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"


def trainer_sharing(config: Any) -> PrefixSharingConfig | None:
    """The actor's sharing config when the trainer should balance by it (sharing on and
    ``trainer.balance_batch`` on), else ``None``: verl's own balancing runs."""
    sharing = PrefixSharingConfig.from_verl(config)
    if not sharing.enabled or not config.trainer.get("balance_batch", True):
        return None
    return sharing


def mini_batch_size_per_rank(config: Any, dp_size: int) -> int | None:
    """Samples per rank per actor mini-batch (``ppo_mini_batch_size x rollout.n / dp``, what
    verl's ``train_mini_batch`` cuts each rank's chunk into); ``None`` when ``actor.shuffle``
    draws the mini-batches at random (their boundaries are then not the order's)."""
    actor = config.actor_rollout_ref.actor
    if actor.get("shuffle", False):
        return None
    global_size = actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    return global_size // dp_size if global_size % dp_size == 0 else None


def partition_batch(sequences: Sequence[Any], dp_size: int, sharing: PrefixSharingConfig, *,
                    uids: Sequence[Hashable] | None, prompt_lens: Sequence[int],
                    mini_batch_size: int | None,
                    padding: Sequence[bool] | None = None) -> DataParallelPartition:
    """The partition verl's dispatch gets: equal counts; ``mini_batch_size`` kept only where
    it divides a rank's count (verl asserts that itself where it matters)."""
    per_rank = len(sequences) // dp_size
    if mini_batch_size is not None and (mini_batch_size > per_rank or per_rank % mini_batch_size):
        mini_batch_size = None
    return partition_data_parallel(sequences, dp_size, sharing, uids=uids,
                                   prompt_lens=prompt_lens, equal_size=True,
                                   mini_batch_size=mini_batch_size, padding=padding)


def balance_metrics(partition: DataParallelPartition, seq_lens: Sequence[int],
                    logging_prefix: str) -> dict[str, float]:
    """verl's ``<logging_prefix>/*`` balance figures for the partition, plus the partition's
    own: token ratio the ranks compute, the ideal (each group on one rank), computed-cost
    imbalance (max / mean), groups split across ranks and across mini-batches."""
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    partitions = [list(p) for p in partition.partitions]
    metrics = log_seqlen_unbalance(seqlen_list=list(seq_lens), partitions=partitions,
                                   prefix=logging_prefix)
    metrics.update(partition.metrics())
    metrics["prefix_sharing/dp_mini_batch_groups_split"] = float(
        partition.mini_batch_groups_split)
    metrics["prefix_sharing/dp_max_tokens_computed"] = float(max(partition.tokens_computed))
    return metrics


def patch_legacy_balancing(module: ModuleType) -> None:
    """Hook on ``verl.trainer.ppo.ray_trainer``: ``RayPPOTrainer._balance_batch`` (verl 0.8.0,
    0.9's ``use_v1: false``) partitions with sharing on. Idempotent."""
    import torch

    def balance(self, sharing, batch, metrics, logging_prefix):
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        input_ids, attention_mask = batch.batch["input_ids"], batch.batch["attention_mask"]
        sequences = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
        prompt_width = batch.batch["prompts"].size(1)  # left-padded prompts, then responses
        prompt_lens = attention_mask[:, :prompt_width].sum(-1).tolist()
        uids = batch.non_tensor_batch.get("uid")
        partition = partition_batch(
            sequences, dp_size, sharing, uids=None if uids is None else list(uids),
            prompt_lens=prompt_lens,
            mini_batch_size=mini_batch_size_per_rank(self.config, dp_size))
        batch.reorder(torch.tensor(partition.order))
        metrics.update(balance_metrics(partition, [len(s) for s in sequences], logging_prefix))

    _replace_balancing(module.RayPPOTrainer, balance)


def patch_v1_balancing(module: ModuleType) -> None:
    """Hook on ``verl.trainer.ppo.v1.trainer_base``: ``PPOTrainer._balance_batch`` (verl 0.9's
    v1 trainer, batch in TransferQueue) partitions with sharing on. verl's padding to the
    required multiple runs first, as in verl's; then each sample's token ids and uid are read
    from TransferQueue (``tq.kv_batch_get``), its prompt length and padding flag from its
    tags. Idempotent."""
    from verl.utils import tensordict_utils as tu

    def balance(self, sharing, batch, metrics, logging_prefix):
        dp_size = _actor_dp_size(self.actor_rollout_wg)
        batch = module.upsample_batch_to_divisible_size(
            batch, self._get_required_batch_multiple(dp_size), self.tokenizer.eos_token_id)
        data = module.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                      select_fields=["input_ids", "uid"])
        sequences = list(data["input_ids"].unbind())
        actor_updates = self.config.trainer.critic_warmup <= self.global_steps
        partition = partition_batch(
            sequences, dp_size, sharing, uids=list(tu.get(data, "uid")),
            prompt_lens=[tag["prompt_len"] for tag in batch.tags],
            mini_batch_size=mini_batch_size_per_rank(self.config, dp_size)
            if actor_updates else None,
            padding=[bool(tag.get("is_padding", False)) for tag in batch.tags])
        seq_lens = [tag["seq_len"] for tag in batch.tags]  # before the reorder moves them
        batch.reorder(partition.order)
        metrics.update(balance_metrics(partition, seq_lens, logging_prefix))
        return batch

    _replace_balancing(module.PPOTrainer, balance)


def _replace_balancing(trainer: type, balance: Any) -> None:
    """Wraps ``trainer._balance_batch`` (once): with sharing on (:func:`trainer_sharing`) it
    runs ``balance(self, sharing, batch, metrics, logging_prefix)`` instead; otherwise verl's
    own, untouched."""
    stock = trainer._balance_batch
    if getattr(stock, "_prefix_sharing_balancing", False):
        return

    @functools.wraps(stock)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen",
                       keep_minibatch=False):
        sharing = trainer_sharing(self.config)
        if sharing is None:
            return stock(self, batch, metrics, logging_prefix, keep_minibatch)
        return balance(self, sharing, batch, metrics, logging_prefix)

    _balance_batch._prefix_sharing_balancing = True
    trainer._balance_batch = _balance_batch


def _actor_dp_size(worker_group: Any) -> int:
    """The actor's data-parallel size from the worker group's dispatch info (queried once)."""
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1


def balancing_hooks() -> dict[str, Any]:
    """The trainer hooks every sharing patch set applies (engine-independent)."""
    return {LEGACY_TRAINER_MODULE: patch_legacy_balancing, V1_TRAINER_MODULE: patch_v1_balancing}
