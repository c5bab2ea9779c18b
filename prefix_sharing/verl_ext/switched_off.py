"""What ``ENABLE_PREFIX_SHARING=0`` patches: only what lets a sharing config run stock verl.

The switch is the prototype's "quick runtime switch for local debugging": the same trainer
config, with ``use_prefix_grouper`` / ``prefix_grouper`` in it, must run verl's own computation
when it is 0 - the results and code path of a run without those keys. Nothing of the engines is
patched then; each patch set's ``off_hooks`` (:func:`off_hooks`) apply only:

- ``verl.workers.config.actor`` / ``.critic`` / ``.engine``: the actor- and critic-config
  classes and the engine-config class (the SFT trainer's ``engine`` section) accept and
  validate ``prefix_grouper`` but hand nothing to the engine (:func:`.config.config_hooks` with
  ``enabled=False``); verl's engine then never sees it. The first such config in a
  process logs one line (:func:`.config.announce`);
- ``verl.trainer.ppo.ray_trainer`` (:func:`stock_balancing`): verl's legacy trainer reads
  ``use_prefix_grouper`` itself, to balance data-parallel ranks by uid group and keep each
  rank's samples in that order (verl 0.8.0's trainer; 0.9.1's default ``use_v1`` trainer does
  not read it). That changes which samples form each mini- and micro-batch, so with the switch
  at 0 the balancing runs as without the key. The trainer's process must import
  ``prefix_sharing`` for this (verl 0.9.1's plugin discovery does, :mod:`.plugin`; on 0.8.0
  ``VERL_USE_EXTERNAL_MODULES=prefix_sharing``): it is also the process that validates the
  config, which fails on ``prefix_grouper`` otherwise.
"""

from __future__ import annotations

import functools
from types import ModuleType

from .config import config_hooks
from .patchsets import Hook

__all__ = ["stock_balancing", "off_hooks", "TRAINER_MODULE"]

TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"


def stock_balancing(module: ModuleType) -> None:
    """Hook on ``verl.trainer.ppo.ray_trainer``: ``RayPPOTrainer._balance_batch`` (and every
    trainer that inherits it) balances as if ``use_prefix_grouper`` were absent. Idempotent."""
    trainer = module.RayPPOTrainer
    stock = trainer._balance_batch
    if getattr(stock, "_prefix_sharing", False):
        return

    @functools.wraps(stock)
    def _balance_batch(self, *args, **kwargs):
        self.use_prefix_grouper = False  # the value verl reads when the key is absent
        return stock(self, *args, **kwargs)

    _balance_batch._prefix_sharing = True
    trainer._balance_batch = _balance_batch


def off_hooks(actor_classes: tuple[str, ...], critic_classes: tuple[str, ...],
              engine_classes: tuple[str, ...]) -> dict[str, Hook]:
    """The ``off_hooks`` of a patch set whose engines read these actor, critic and engine
    config classes."""
    return {**config_hooks(actor_classes, critic_classes, engine_classes, enabled=False),
            TRAINER_MODULE: stock_balancing}
