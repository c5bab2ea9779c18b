"""Recurrent layers under prefix sharing: the state carried across shared prefixes.

A reuser's tail starts from its provider's state at the branch point. :mod:`.schedule` turns a
plan into pieces, parents and depth buckets once per micro-batch; :mod:`.gated_delta` runs the
Gated DeltaNet kernels (torch reference or flash-linear-attention) over that schedule, and
:mod:`.ssd` the Mamba-2 scan (torch reference or mamba_ssm) with the same state passing.
Layer-free: framework adapters (HuggingFace, Megatron) build their GDN and Mamba-2 modules on it.
"""

from .gated_delta import (
    RECURRENT_BACKENDS,
    causal_conv1d,
    causal_conv1d_over_schedule,
    chunk_gated_delta_rule,
    gated_delta_rule_over_schedule,
    resolve_recurrent_backend,
)
from .schedule import Piece, RecurrenceBucket, RecurrenceSchedule, build_schedule, recurrence_schedule
from .ssd import SSD_BACKENDS, chunk_ssd, resolve_ssd_backend, ssd_over_schedule

__all__ = [
    "Piece",
    "RECURRENT_BACKENDS",
    "RecurrenceBucket",
    "RecurrenceSchedule",
    "SSD_BACKENDS",
    "build_schedule",
    "causal_conv1d",
    "causal_conv1d_over_schedule",
    "chunk_gated_delta_rule",
    "chunk_ssd",
    "gated_delta_rule_over_schedule",
    "recurrence_schedule",
    "resolve_recurrent_backend",
    "resolve_ssd_backend",
    "ssd_over_schedule",
]
