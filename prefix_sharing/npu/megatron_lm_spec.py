"""The layer spec for Megatron-LM on Ascend, with MindSpeed::

    pretrain_gpt.py ... --spec prefix_sharing.npu.megatron_lm_spec layer_spec

:func:`~prefix_sharing.npu.enable_mindspeed` runs first, so the spec is built from the classes
MindSpeed has put in place (its Transformer Engine stand-ins, its norms) and the
``prefix-sharing`` feature guards the run, repatches included. Otherwise it is
``prefix_sharing.megatron_ext.megatron_lm_spec.layer_spec``.
"""

from __future__ import annotations

from .mindspeed import enable_mindspeed

enable_mindspeed()

from ..megatron_ext.megatron_lm_spec import layer_spec  # noqa: E402  (after MindSpeed's patches)

__all__ = ["layer_spec"]
