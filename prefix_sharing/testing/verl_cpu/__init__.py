"""verl's real trainer (``python -m verl.trainer.main_ppo``) on a CPU-only machine: test support.

Loaded through verl's own plugin hook, in the driver and in every Ray worker::

    VERL_USE_EXTERNAL_MODULES=prefix_sharing.testing.verl_cpu VERL_PLATFORM=cpu \\
        python -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=hf trainer.device=cpu ...

Importing it installs, for the verl release it finds (0.9.1 or 0.8.0): a CPU platform (device
cpu, gloo; 0.9.1 only: 0.8.0 has no platform layer), verl's FSDP and Megatron engines
registered for "cpu" (the Megatron engine's CPU run and its stand-in for Transformer Engine's
layer spec: ``megatron.py``), the process-group backend rewritten to plain gloo, CPU offload without pinned memory, and a
rollout named ``hf`` that runs ``transformers.generate`` behind verl's ``RolloutReplica`` /
``ServerAdapter`` (``rollout.py``). Nothing here is imported by ``import prefix_sharing``: it is
never on a GPU user's path. ``assets.py`` makes the tiny model, tokenizer and data offline;
``runner.py`` launches the trainer and reads its per-step metrics back.
"""

from __future__ import annotations

import sys

ROLLOUT_NAME = "hf"


def _install() -> None:
    if "verl" not in sys.modules:  # imported by the runner or the assets, not by verl's hook
        return
    from . import megatron, patches, rollout

    patches.install()
    megatron.install()
    rollout.register(ROLLOUT_NAME)


_install()
