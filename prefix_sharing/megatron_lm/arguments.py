"""The entry point's own command-line arguments, added to Megatron-LM's parser.

Megatron-LM's arguments keep their meaning; the sharing settings have a ``--prefix-sharing-``
prefix and map one to one onto :class:`~prefix_sharing.PrefixSharingConfig`.
"""

from __future__ import annotations

import argparse

from ..config import BACKENDS, PrefixSharingConfig
from ..errors import InputError
from ..refusals import refuse

__all__ = [
    "SPEC", "SHARING_SPECS", "add_prefix_sharing_args", "sharing_config", "check_megatron_args",
]

SPEC = ["prefix_sharing.megatron_ext.megatron_lm_spec", "layer_spec"]
"""The spec the entry point builds its model with when ``--spec`` is not given."""
SHARING_SPECS = (SPEC, ["prefix_sharing.npu.megatron_lm_spec", "layer_spec"])  # CUDA/CPU, Ascend


def add_prefix_sharing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``."""
    group = parser.add_argument_group(title="prefix sharing")
    group.add_argument("--prefix-sharing-mode", choices=("arbitrary_prefix", "off"),
                       default="arbitrary_prefix",
                       help="arbitrary_prefix: compute every shared prefix of a micro-batch once; "
                            "off: compute every token (same model and data, for comparison)")
    group.add_argument("--prefix-sharing-min-prefix-len", type=int, default=8,
                       help="share only prefixes of at least this many tokens")
    group.add_argument("--prefix-sharing-min-group-size", type=int, default=2,
                       help="share only prefixes held by at least this many sequences")
    group.add_argument("--prefix-sharing-backend", choices=BACKENDS, default="auto",
                       help="attention kernel of the sharing core attention")
    group.add_argument("--prefix-sharing-data", default=None,
                       help="gpt: the rollout / trajectory file to train on (JSONL or Parquet)")
    group.add_argument("--prefix-sharing-token-budget", type=int, default=None,
                       help="gpt: the most tokens one micro-batch computes (default --seq-length)")
    return parser


def sharing_config(args: argparse.Namespace) -> PrefixSharingConfig:
    """The :class:`PrefixSharingConfig` the arguments ask for."""
    return PrefixSharingConfig(
        mode=args.prefix_sharing_mode,
        min_prefix_len=args.prefix_sharing_min_prefix_len,
        min_group_size=args.prefix_sharing_min_group_size,
        backend=args.prefix_sharing_backend,
    )


def check_megatron_args(args: argparse.Namespace, kind: str) -> None:
    """Refuses, by name, Megatron-LM settings this entry point does not run exactly."""
    if args.spec is not None and args.spec not in SHARING_SPECS:
        allowed = " or ".join(" ".join(spec) for spec in SHARING_SPECS)
        raise refuse("megatron_lm.spec", f"--spec {' '.join(args.spec)}; use --spec {allowed} "
                     "(the first when --spec is left out)")
    if args.context_parallel_size > 1:
        raise refuse("megatron_lm.context_parallel",
                     f"--context-parallel-size {args.context_parallel_size}")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise refuse("megatron_lm.combined_1f1b")
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise refuse("megatron_lm.virtual_pipeline",
                     f"{args.virtual_pipeline_model_parallel_size} virtual pipeline stages")
    if kind == "gpt":
        if args.prefix_sharing_data is None:  # a missing input, not a refused setting
            raise InputError("gpt needs --prefix-sharing-data <rollout file>")
        if args.micro_batch_size != 1:
            raise refuse("megatron_lm.micro_batch_size",
                         f"--micro-batch-size {args.micro_batch_size}")
    elif args.data_path is None or len(args.data_path) != 1:
        raise InputError("sft needs --data-path <conversations.jsonl> (one file)")
