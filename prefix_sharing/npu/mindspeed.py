"""Keeps prefix sharing in force under MindSpeed, Ascend's patch layer for megatron-core.

Importing ``mindspeed.megatron_adaptor`` patches megatron-core in place: every MindSpeed
*feature* in ``MindSpeedFeaturesManager.FEATURES_LIST`` registers replacements with
``MindSpeedPatchesManager.register_patch``, which sets them on the target and on every loaded
module holding the original object. ``megatron_adaptor.repatch(args)`` (verl's MindSpeed engine
calls it) removes *every* registered patch and wrapper, then asks the features again - so a
patch registered on its own does not survive a repatch, a feature in that list does.

What MindSpeed's patches do to the prefix-sharing layers (MindSpeed branch ``core_r0.16.0``):

- ``DotProductAttention.forward`` becomes MindSpeed's fused attention (TND with ``sparse_mode``
  0 or 2, top-left causal; a reuser's tail needs bottom-right). ``PrefixSharingCoreAttention``
  overrides ``forward`` and runs its own kernels on a planned micro-batch, so it is unaffected;
  but a layer spec that is *not* the prefix-sharing one would compute a plan with the wrong mask.
- RoPE (``rope_utils.apply_rotary_pos_emb`` / ``_apply_rotary_pos_emb_bshd``) becomes MindSpeed's
  fused rotary: the same rotation, which the per-token RoPE of ``PrefixSharingSelfAttention`` may
  use; its THD branch restarts positions per segment and is never used for a plan.
- ``--reset-attention-mask`` (end-of-document reset) wraps ``GPTModel.forward`` and *replaces* the
  ``packed_seq_params`` argument with its own segments: the plan would be silently dropped.
- ``--tp-2d`` replaces ``SelfAttention.__init__`` and the rotary embedding class; ALiBi replaces
  the ``DotProductAttention`` class itself.
- A context-parallel size above 1 (``features_manager/context_parallel/``) replaces the
  ``DotProductAttention`` class with its CP class, whose ``forward`` runs the algorithm of
  ``--context-parallel-algo``; wraps ``Attention.__init__``; and replaces megatron's
  ``initialize_model_parallel`` (extra groups), ``get_batch_on_this_cp_rank`` (Megatron-LM's
  batch split) and ``get_pos_emb_on_this_cp_rank`` (RoPE table slicing). With
  ``megatron_cp_algo`` (ring attention, MindSpeed's default) none of it reaches a planned
  micro-batch: ``PrefixSharingCoreAttention`` overrides ``forward`` and does the project's own CP
  communication (the plan's row split, a K/V all-gather, one log-prob all-reduce:
  :mod:`prefix_sharing.megatron_ext.context_parallel`), RoPE slices its table only for
  non-packed input, and the project's Megatron-LM entry point refuses CP. The other algorithms
  bring their own communication around or instead of that attention, and are refused by name
  (:data:`CP_ALGORITHMS_REFUSED`). The prefix-sharing classes must have been defined on
  megatron's own ``DotProductAttention``, not on MindSpeed's CP class: :func:`enable_mindspeed`
  imports them before MindSpeed's CP patch can be in place, and a later definition is refused.

:func:`enable_mindspeed` adds one feature, ``prefix-sharing``, to MindSpeed's list. It refuses
the options above with the option named, and wraps ``DotProductAttention.forward`` so that a
planned micro-batch reaching MindSpeed's attention raises instead of being computed wrong. Being a
feature, it is registered again by every ``repatch``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any, Callable
from ..refusals import Refused, refuse, refuse_all



__all__ = ["FEATURE_NAME", "CP_ALGORITHMS_REFUSED", "enable_mindspeed", "incompatible_options"]

FEATURE_NAME = "prefix-sharing"
DOT_PRODUCT_ATTENTION_FORWARD = (
    "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"
)
# ``--context-parallel-algo`` values (MindSpeed ``core_r0.16.0`` and MindSpeed-LLM) whose
# communication would bypass the plan's split, each with what it does instead. Only
# ``megatron_cp_algo`` runs with sharing: its ring attention is the CP class's forward, which
# the prefix-sharing core attention overrides.
CP_ALGORITHMS_REFUSED = {
    "ulysses_cp_algo": "MindSpeed wraps the core attention in its Ulysses all-to-all "
                       "(UlyssesContextAttention, from Attention.__init__), which hands it whole "
                       "sequences of a subset of heads in place of the plan's rows",
    "hybrid_cp_algo": "MindSpeed wraps the core attention in its Ulysses all-to-all over part of "
                      "the CP group (UlyssesContextAttention) around a ring over the rest",
    "hybrid_adaptive_cp_algo": "MindSpeed wraps the core attention in its Ulysses all-to-all "
                               "around its adaptive ring schedule",
    "adaptive_cp_algo": "MindSpeed schedules which rank attends to which tokens itself "
                        "(adaptive_attn_context_parallel over its own batch layout)",
    "kvallgather_cp_algo": "MindSpeed-LLM gathers K/V in its own TE-style attention over its own "
                           "split of each sequence",
}
SHARED_CP_ALGORITHM = "megatron_cp_algo"


def enable_mindspeed() -> None:
    """Registers the ``prefix-sharing`` feature with MindSpeed and applies it; idempotent.

    Imports ``mindspeed.megatron_adaptor`` if it is not imported yet (which patches megatron-core,
    as on any Ascend run), so it may be called before or after that import and before or after
    ``prefix_sharing.megatron_ext``. Call it before building the model.

    Raises:
        ImportError: MindSpeed is not installed.
        UnsupportedSetupError: MindSpeed runs with an option that defeats prefix sharing.
    """
    if importlib.util.find_spec("mindspeed") is None:
        raise ImportError(
            "enable_mindspeed needs MindSpeed (Ascend/MindSpeed, branch core_r0.16.0 for "
            "megatron-core 0.16); see docs/npu.md"
        )
    # the prefix-sharing layers are defined on megatron's own DotProductAttention, before a
    # repatch with a context-parallel size can put MindSpeed's CP class in its place
    importlib.import_module("prefix_sharing.megatron_ext")
    importlib.import_module("mindspeed.megatron_adaptor")
    from mindspeed.args_utils import get_full_args
    from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager

    features = MindSpeedFeaturesManager.FEATURES_LIST
    key = _feature_key()
    feature = next((f for f in features if getattr(f, "feature_name", None) == key), None)
    if feature is None:
        feature = _feature_class()()
        features.append(feature)  # after MindSpeed's own: its wrapper sees their replacements
    feature.register_patches(MindSpeedPatchesManager, get_full_args())
    MindSpeedPatchesManager.apply_patches()


def incompatible_options(args: Any) -> list[str]:
    """The MindSpeed / Megatron-LM options in ``args`` under which sharing would be wrong, one
    message part each (see :func:`_refused_options`)."""
    return [str(refused) for refused in _refused_options(args)]


def _refused_options(args: Any) -> list[Refused]:
    found = []
    if getattr(args, "reset_attention_mask", False):
        found.append(Refused("ascend.reset_attention_mask", "--reset-attention-mask"))
    if getattr(args, "tp_2d", False):
        found.append(Refused("ascend.tp_2d", "--tp-2d"))
    if getattr(args, "position_embedding_type", None) == "alibi":
        found.append(Refused("ascend.alibi", "--position-embedding-type alibi"))
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        found += _context_parallel_problems(args)
    return found


def _context_parallel_problems(args: Any) -> list[Refused]:
    """Context parallelism runs with ``megatron_cp_algo`` only (see the module doc), on
    prefix-sharing layers defined on megatron's own attention class."""
    cp = f"--context-parallel-size {args.context_parallel_size}"
    algorithm = getattr(args, "context_parallel_algo", None) or SHARED_CP_ALGORITHM
    found = []
    if algorithm != SHARED_CP_ALGORITHM:
        reason = CP_ALGORITHMS_REFUSED.get(
            algorithm, "an algorithm not validated with prefix sharing")
        found.append(Refused("ascend.context_parallel_algo",
                             f"{cp} with --context-parallel-algo {algorithm}: {reason}"))
    base = _mindspeed_attention_base()
    if base is not None:
        found.append(Refused("ascend.import_order",
                             f"{cp}: PrefixSharingCoreAttention was defined on MindSpeed's {base}"))
    return found


def _mindspeed_attention_base() -> str | None:
    """The name of a MindSpeed class among the prefix-sharing core attention's bases, if its
    module was imported after MindSpeed replaced ``DotProductAttention``; else ``None``."""
    module = sys.modules.get("prefix_sharing.megatron_ext.core_attention")
    if module is None:
        return None
    for cls in module.PrefixSharingCoreAttention.__mro__[1:]:
        if cls.__module__.split(".")[0] in ("mindspeed", "mindspeed_llm"):
            return cls.__name__
    return None


def _feature_key() -> str:
    """``FEATURE_NAME`` as MindSpeedFeature stores it (lower case, ``-`` -> ``_``)."""
    return FEATURE_NAME.replace("-", "_")


@functools.cache
def _feature_class() -> type:
    """The feature class, defined once MindSpeed is importable (its base class lives there)."""
    from mindspeed.features_manager.feature import MindSpeedFeature

    class PrefixSharingFeature(MindSpeedFeature):
        """Always applied (optimization level 0), so every ``repatch`` registers it again."""

        def __init__(self) -> None:
            super().__init__(FEATURE_NAME, optimization_level=0)

        def validate_args(self, args: Any) -> None:
            from ..megatron_ext.checks import UnsupportedSetupError

            found = _refused_options(args)
            if found:
                raise refuse_all(found, error=UnsupportedSetupError)

        def register_patches(self, patch_manager: Any, args: Any) -> None:
            self.validate_args(args)  # MindSpeed validates before this feature may be listed
            patch_manager.register_patch(DOT_PRODUCT_ATTENTION_FORWARD, plan_guard_wrapper)

    return PrefixSharingFeature


def plan_guard_wrapper(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``DotProductAttention.forward`` (MindSpeed stacks functions named ``*wrapper``).

    Only core attention that is not ``PrefixSharingCoreAttention`` gets here with a plan (that
    class overrides ``forward``); MindSpeed's fused attention would give a reuser's tail the
    top-left causal mask, so it raises instead.
    """

    @functools.wraps(forward)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        # forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
        #         packed_seq_params)
        packed = kwargs.get("packed_seq_params", args[6] if len(args) > 6 else None)
        if _is_plan(packed):
            from ..megatron_ext.checks import UnsupportedSetupError

            raise refuse("ascend.fused_attention", f"{type(self).__name__}.forward",
                         error=UnsupportedSetupError)
        return forward(self, *args, **kwargs)

    return guarded


def _is_plan(packed_seq_params: Any) -> bool:
    module = sys.modules.get("prefix_sharing.megatron_ext.packed_seq")
    return module is not None and isinstance(packed_seq_params, module.PlanPackedSeqParams)
