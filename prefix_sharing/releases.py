"""The releases this package is tested on, one table per project, read by modules that must
not import each other.

- :data:`MEGATRON_CORE_RELEASES`: read by the Megatron adapter's import guard
  (:mod:`prefix_sharing.megatron_ext.release`) and by the verl patch-set names
  (:mod:`prefix_sharing.verl_ext.names`). Each release maps to the oldest Python it installs on
  (0.17 and later are built for 3.12+).
- :data:`VERL_RELEASES`: the verl releases with patch sets, and the engines each one has a set
  for. The patch-set modules (:mod:`prefix_sharing.verl_ext.mcore_engine`, ``.mindspeed``,
  ``.fsdp``) register ``verl<digits>_<engine>`` for every release listed with their engine
  (:func:`verl_patchsets`), and the CPU test support for verl's trainer
  (:mod:`prefix_sharing.testing.verl_cpu`) knows exactly these releases. A new verl release is
  a row here, plus whatever its seams need in those modules.
"""

from __future__ import annotations

__all__ = ["MEGATRON_CORE_RELEASES", "VERL_RELEASES", "verl_patchsets"]

MEGATRON_CORE_RELEASES: dict[str, tuple[int, int]] = {
    "0.16.1": (3, 10),
    "0.17.1": (3, 12),
    "0.18.2": (3, 12),
    "0.19.2": (3, 12),
}

# verl release -> the engines a patch set targets on it ("mcore": the Megatron engine,
# "mcore_mindspeed": the MindSpeed engine on top of it, "fsdp": the FSDP engine).
VERL_RELEASES: dict[str, tuple[str, ...]] = {
    "0.9.1": ("mcore", "mcore_mindspeed", "fsdp"),
    "0.8.0": ("mcore", "mcore_mindspeed", "fsdp"),
}


def verl_patchsets(engine: str) -> tuple[tuple[str, str], ...]:
    """``(release, patch-set name)`` for every verl release with a patch set for ``engine``:
    ``(("0.9.1", "verl091_mcore"), ("0.8.0", "verl080_mcore"))`` for ``"mcore"``."""
    return tuple((release, f"verl{release.replace('.', '')}_{engine}")
                 for release, engines in VERL_RELEASES.items() if engine in engines)
