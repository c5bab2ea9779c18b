"""``python -m prefix_sharing.megatron_lm {gpt,sft} <Megatron-LM arguments>``: Megatron-LM's own
``pretrain()`` with the sharing layer spec and the sharing forward step.

- ``sft``: Megatron-LM's SFT dataset (``--data-path conversations.jsonl``, Megatron-LM's
  tokenizer arguments); each micro-batch's packed conversations are split at ``cu_seqlens`` and
  planned together.
- ``gpt``: a rollout / trajectory file (``--prefix-sharing-data rollouts.jsonl``) split into
  group-keeping micro-batches under a computed-token budget.

This follows megatron-core 0.17+'s bundled ``megatron.training`` (``parse_and_validate_args``,
``gpt_config_from_args``, ``pretrain(config_container, ...)``). Without CUDA it runs on the CPU
over gloo (:mod:`.cpu_support`; pass ``--distributed-backend gloo``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from .arguments import SPEC, add_prefix_sharing_args, check_megatron_args, sharing_config

__all__ = ["main", "KINDS"]

KINDS = ("gpt", "sft")


def main(argv: Sequence[str] | None = None) -> None:
    """Runs Megatron-LM's training loop; ``argv`` is ``[kind, *megatron_lm_arguments]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in KINDS:
        raise SystemExit(
            "usage: python -m prefix_sharing.megatron_lm {gpt,sft} <Megatron-LM arguments> "
            "[--prefix-sharing-mode ...]"
        )
    kind, rest = argv[0], argv[1:]
    sys.argv = [f"prefix_sharing.megatron_lm {kind}", *rest]  # Megatron-LM parses sys.argv
    _require_megatron_training()
    if not torch.cuda.is_available():
        from .cpu_support import enable_cpu_megatron_lm

        enable_cpu_megatron_lm()
    _use_shipped_dataset_helpers()
    _share_mtp_block_spec()

    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain

    from .datasets_provider import datasets_provider
    from .forward_step import make_forward_step

    args = parse_and_validate_args(extra_args_provider=add_prefix_sharing_args)
    check_megatron_args(args, kind)
    config = sharing_config(args)
    args.spec = args.spec or SPEC
    if args.pipeline_model_parallel_size > 1:
        # every micro-batch's flat layout has its own length: pipeline stages exchange shapes
        args.variable_seq_lengths = True
        if not args.num_experts:  # megatron-core's check, though no MoE layer dispatches
            args.moe_token_dispatcher_type = "alltoall"
    model_config = gpt_config_from_args(args)
    container = pretrain_cfg_container_from_args(args, model_config)
    pretrain(container, datasets_provider(kind, config), ModelType.encoder_or_decoder,
             make_forward_step(config))


def _use_shipped_dataset_helpers() -> None:
    """megatron.training's initialize runs ``make`` in megatron/core/datasets to build the
    dataset helpers, but the megatron-core wheel ships them compiled and no Makefile, so the
    build fails (on any machine); with the compiled module importable there is nothing to build.
    """
    from megatron.core.datasets import utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron-LM build them
    utils.compile_helpers = lambda: None


def _share_mtp_block_spec() -> None:
    """Megatron-LM builds the MTP block spec from megatron-core's default decoder layer spec,
    not from ``--spec``: its MTP layers get the sharing core attention the same way
    (:func:`~prefix_sharing.megatron_ext.with_prefix_sharing`); the forward step gives the
    model the sharing postprocess (:func:`~prefix_sharing.megatron_ext.share_multi_token_prediction`).
    """
    from megatron.training.models import gpt

    from ..megatron_ext import with_prefix_sharing

    stock = gpt.mtp_block_spec
    if getattr(stock, "_prefix_sharing", False):
        return

    def mtp_block_spec(*args, **kwargs):
        spec = stock(*args, **kwargs)
        return None if spec is None else with_prefix_sharing(spec)

    mtp_block_spec._prefix_sharing = True
    gpt.mtp_block_spec = mtp_block_spec


def _require_megatron_training() -> None:
    try:
        import megatron.training.argument_utils  # noqa: F401
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("megatron"):
            raise
        raise SystemExit(
            "prefix_sharing.megatron_lm needs Megatron-LM's megatron.training with "
            "argument_utils (megatron-core >= 0.17 on Python 3.12 ships it); with megatron-core "
            "0.16.1 use a Megatron-LM core_r0.16.0 checkout's pretrain_gpt.py with "
            "--spec prefix_sharing.megatron_ext.megatron_lm_spec layer_spec"
        ) from error
