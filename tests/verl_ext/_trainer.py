"""verl's trainers, built just far enough to run their real ``_balance_batch`` on CPU.

A trainer is ``object.__new__`` of verl's class plus the attributes ``_balance_batch`` reads:
the config, an actor worker group that answers its dispatch info (``dp`` ranks), and for the
v1 trainer a tokenizer's EOS id, the step and the critic flag. The v1 trainer's batch lives in
TransferQueue, whose client needs a Ray controller actor: :class:`FakeTransferQueue` stands in
for it, implementing only the two calls ``_balance_batch`` and verl's padding make
(``kv_batch_get``, ``kv_batch_put``) over a dict, and packing what it returns field by field
with TransferQueue's own ``AsyncSimpleStorageManager._pack_field_values`` (jagged nested
tensors, NonTensorStacks), as its storage does.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch


def trainer_config(*, sharing: dict | None, dp: int, n: int, mini_batch_prompts: int,
                   balance_batch: bool = True):
    """The config sections ``_balance_batch`` reads; ``sharing``: the ``prefix_grouper``
    block (``None``: no ``use_prefix_grouper``)."""
    from omegaconf import OmegaConf

    actor = dict(ppo_mini_batch_size=mini_batch_prompts, shuffle=False)
    if sharing is not None:
        actor.update(use_prefix_grouper=True, prefix_grouper=sharing)
    return OmegaConf.create(dict(
        actor_rollout_ref=dict(actor=actor, rollout=dict(n=n)),
        trainer=dict(balance_batch=balance_batch, critic_warmup=0, n_gpus_per_node=dp),
        critic=dict(ppo_mini_batch_size=mini_batch_prompts),
    ))


class _WorkerGroup:
    def __init__(self, dp: int) -> None:
        self._dispatch_info = {}
        self._dp = dp

    def _query_dispatch_info(self, role: str) -> list[int]:
        return list(range(self._dp))


def legacy_trainer(config, dp: int):
    """``verl.trainer.ppo.ray_trainer.RayPPOTrainer``, as its ``__init__`` leaves what
    ``_balance_batch`` reads."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = config
    trainer.actor_rollout_wg = _WorkerGroup(dp)
    trainer.use_prefix_grouper = config.actor_rollout_ref.actor.get("use_prefix_grouper", False)
    return trainer


def v1_trainer(config, dp: int, eos_token_id: int = 2):
    """verl 0.9's synchronous v1 trainer (``PPOTrainerSync``, whose ``_balance_batch`` is its
    base ``trainer_base.PPOTrainer``'s), likewise."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)
    trainer.config = config
    trainer.actor_rollout_wg = _WorkerGroup(dp)
    trainer.tokenizer = types.SimpleNamespace(eos_token_id=eos_token_id)
    trainer.use_critic = False
    trainer.global_steps = 1
    return trainer


def legacy_batch(prompts: list[torch.Tensor], responses: list[torch.Tensor], uids: list[str]):
    """The legacy trainer's ``DataProto`` after rollout: left-padded prompts, right-padded
    responses, masks, ``uid`` in the non-tensor batch."""
    from verl import DataProto

    size = len(prompts)
    max_p, max_r = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(size, max_p + max_r, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, max_p - len(p): max_p], input_ids[i, max_p: max_p + len(r)] = p, r
        attention_mask[i, max_p - len(p): max_p + len(r)] = 1
    return DataProto.from_dict(
        tensors=dict(input_ids=input_ids, attention_mask=attention_mask,
                     prompts=input_ids[:, :max_p], responses=input_ids[:, max_p:],
                     response_mask=attention_mask[:, max_p:]),
        non_tensors=dict(uid=np.array(uids, dtype=object)))


class FakeTransferQueue:
    """``kv_batch_put`` / ``kv_batch_get`` over a dict of per-sample fields (see the module
    doc); :meth:`install` puts them on the ``transfer_queue`` module verl calls."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], dict[str, Any]] = {}
        self.tags: dict[tuple[str, str], dict] = {}

    def install(self, monkeypatch) -> None:
        import transfer_queue

        monkeypatch.setattr(transfer_queue, "kv_batch_put", self.kv_batch_put)
        monkeypatch.setattr(transfer_queue, "kv_batch_get", self.kv_batch_get)

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None, data_parser=None):
        from tensordict import NonTensorStack
        from transfer_queue import KVBatchMeta

        columns = {name: column.tolist() if isinstance(column, NonTensorStack)
                   else column.unbind() for name, column in ({} if fields is None
                                                             else fields.items())}
        for i, key in enumerate(keys):
            sample = self.samples.setdefault((partition_id, key), {})
            sample.update({name: values[i] for name, values in columns.items()})
            if tags is not None:
                self.tags[partition_id, key] = dict(tags[i])
        return KVBatchMeta(keys=list(keys), tags=[self.tags.get((partition_id, k), {})
                                                  for k in keys], partition_id=partition_id)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from tensordict import TensorDict
        from transfer_queue.storage.managers.simple_storage_manager import (
            AsyncSimpleStorageManager)

        keys = [keys] if isinstance(keys, str) else list(keys)
        rows = [self.samples[partition_id, key] for key in keys]
        names = list(rows[0]) if select_fields is None else (
            [select_fields] if isinstance(select_fields, str) else list(select_fields))
        pack = AsyncSimpleStorageManager._pack_field_values
        return TensorDict({name: pack([row[name] for row in rows]) for name in names},
                          batch_size=[len(rows)])


def v1_batch(fake: FakeTransferQueue, prompts, responses, uids: list[str]):
    """The v1 trainer's batch: each sample put as its agent loop puts it (fields and the
    ``prompt_len`` / ``response_len`` / ``seq_len`` tags), keys ``{uid}_{session}_0``."""
    from tensordict import TensorDict
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields, tags, sessions = [], [], [], {}
    for p, r, uid in zip(prompts, responses, uids):
        session = sessions[uid] = sessions.get(uid, -1) + 1
        input_ids = torch.cat([p, r])
        keys.append(f"{uid}_{session}_0")
        fields.append(dict(prompts=p, responses=r, input_ids=input_ids,
                           attention_mask=torch.ones_like(input_ids),
                           position_ids=torch.arange(len(input_ids)),
                           response_mask=torch.ones_like(r), uid=uid, session_id=session))
        tags.append(dict(status="success", prompt_len=len(p), response_len=len(r),
                         seq_len=len(p) + len(r)))
    td: TensorDict = list_of_dict_to_tensordict(fields)
    return fake.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=tags)
