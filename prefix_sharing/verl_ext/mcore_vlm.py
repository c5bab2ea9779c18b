"""Why verl's Megatron engine refuses a vision-language model with sharing on, at construction.

verl builds a VLM's Megatron model through one of two bridges, and neither runs on a CPU, so
verl's own Megatron VLM step - the reference a shared step must equal - has not run here
(checked 2026-12 on verl 0.8.0 and 0.9.1, megatron-core 0.16.1, mbridge 0.15.1, Megatron-Bridge
0.6.2):

- Megatron-Bridge (verl 0.9.1's default): ``import megatron.bridge`` imports
  ``transformer_engine.pytorch`` (``megatron/bridge/peft/lora_layers.py``), which has no CPU
  build.
- mbridge 0.15.1 (verl 0.8.0's default, 0.9.1's ``vanilla_mbridge``): its Qwen2.5-VL provider
  builds the language model from the Transformer-Engine spec (``NameError: TENorm`` without
  TE), the vision tower from ``get_vit_layer_with_transformer_engine_spec`` and its projection
  from TE linears, and runs the vision tower's windowed attention packed
  (``packed_seq_params``), which megatron's ``DotProductAttention`` refuses. Independently of
  the device, its ``Qwen2_5VLSelfAttention.forward`` does not take the ``rotary_pos_cos_sin``
  keyword that megatron-core 0.16.1's ``TransformerLayer`` passes (``TypeError``). With CPU
  stand-ins for all of these, the model runs one unpacked sequence forward and backward, but
  verl's packed call (padded ids, mask, THD ``packed_seq_params``) fails in the model's RoPE:
  it embeds the padded batch and never packs it.

On the sharing side, the Megatron plan carries one position per computed token, and a Qwen VLM's
multimodal RoPE takes three rows per token (``megatron.mrope``). verl's FSDP engine serves
Qwen2.5-VL and Qwen3-VL with their images (:mod:`.vlm`).
"""

from __future__ import annotations

from typing import Any

from ..refusals import Refused

__all__ = ["vision_model_problem"]


def vision_model_problem(model_config: Any) -> Refused | None:
    """``verl.megatron_vlm`` when ``model_config`` (verl's ``HFModelConfig``) has a vision tower,
    as verl itself detects one (a ``vision_config``); None otherwise. Asked at the engine's
    construction, before verl imports a bridge, so a user meets this reason rather than a
    Transformer Engine import error."""
    hf_config = getattr(model_config, "hf_config", None)
    if getattr(hf_config, "vision_config", None) is None:
        return None
    return Refused("verl.megatron_vlm",
                   f"{getattr(hf_config, 'model_type', 'the model')} has a vision_config")
