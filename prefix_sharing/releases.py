"""The megatron-core releases this package is tested on: one table, read by the Megatron
adapter's import guard (:mod:`prefix_sharing.megatron_ext.release`) and by the verl patch-set
names (:mod:`prefix_sharing.verl_ext.names`), which must not import each other.

Each release maps to the oldest Python it installs on (0.17 and later are built for 3.12+).
"""

from __future__ import annotations

__all__ = ["MEGATRON_CORE_RELEASES"]

MEGATRON_CORE_RELEASES: dict[str, tuple[int, int]] = {
    "0.16.1": (3, 10),
    "0.17.1": (3, 12),
    "0.18.2": (3, 12),
    "0.19.2": (3, 12),
}
