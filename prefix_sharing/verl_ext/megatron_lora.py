"""LoRA in verl's Megatron engine: refused with sharing on, at construction.

verl (0.8.0 and 0.9.1) trains LoRA on its Megatron engine only through Megatron-Bridge's PEFT
(``model.lora.rank > 0``: ``verl/workers/config/megatron_peft.py::get_peft_cls`` asserts a
Megatron-Bridge provider, then ``megatron.bridge.peft.utils.create_peft``), and
``import megatron.bridge`` imports ``transformer_engine.pytorch``
(``megatron/bridge/peft/lora_layers.py``), which has no CPU build. So verl's own Megatron LoRA
step - the reference a shared step must equal - has not run here, and sharing does not claim
it. Nothing in the LoRA adapters themselves stands in the way (they wrap the linear layers,
per token, as in the FSDP engine, which serves LoRA: ``tests/verl_ext/test_fsdp_lora.py``).
"""

from __future__ import annotations

from typing import Any

from ..refusals import Refused

__all__ = ["megatron_lora_problem"]


def megatron_lora_problem(model_config: Any) -> Refused | None:
    """``verl.megatron_lora`` when ``model_config`` (verl's ``HFModelConfig``) asks the Megatron
    engine for LoRA (``lora.rank > 0``); None otherwise."""
    lora = getattr(model_config, "lora", None) or {}
    rank = lora.get("rank", 0) if hasattr(lora, "get") else 0
    if not rank or rank <= 0:
        return None
    return Refused("verl.megatron_lora", f"model.lora.rank={rank}")
