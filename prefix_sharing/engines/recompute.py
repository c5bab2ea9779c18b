"""Megatron-core's activation recompute as the commands name it (``--recompute``).

A leaf (no megatron import): the TransformerConfig fields each name sets, on every model of a
run - the shared one and the plain and reference runs it is judged against.
"""

from __future__ import annotations

__all__ = ["RECOMPUTE", "recompute_settings"]

RECOMPUTE: dict[str, dict] = {
    # every layer's forward replayed in the backward, one layer per checkpoint
    "full": dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1),
    # megatron's default selective module: core attention
    "selective": dict(recompute_granularity="selective"),
}


def recompute_settings(name: str | None) -> dict:
    """The TransformerConfig fields of ``--recompute name`` (none for None)."""
    return {} if name is None else dict(RECOMPUTE[name])
