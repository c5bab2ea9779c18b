"""Ascend NPUs: MindSpeed keeps its patches off the prefix-sharing layers.

The attention kernel itself is ``backend="npu"`` (``prefix_sharing.attention.npu_backend``,
``torch_npu.npu_fusion_attention``). This package adapts to MindSpeed, which patches
megatron-core in place on Ascend::

    import mindspeed.megatron_adaptor            # before or after prefix_sharing, either way
    from prefix_sharing.npu import enable_mindspeed
    enable_mindspeed()                           # before building the model; survives repatch

Megatron-LM on Ascend: ``--spec prefix_sharing.npu.megatron_lm_spec layer_spec`` does both.
Importing this package imports neither MindSpeed nor megatron-core.
"""

from .mindspeed import enable_mindspeed, incompatible_options

__all__ = ["enable_mindspeed", "incompatible_options"]
