"""The ready overlays in ``configs/verl/`` through verl's own config conversion, for any actor
config class: what the trainer does with them, without a trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# overlay file -> the sharing mode it asks for
OVERLAY_MODES = [
    ("grpo_arbitrary_prefix.yaml", "arbitrary_prefix"),
    ("grpo_prompt_only.yaml", "prompt_only"),
    ("tree_agent.yaml", "arbitrary_prefix"),
]


def overlay_configs(overlay: str, section: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``configs/verl/<overlay>`` merged over an ``actor_rollout_ref`` whose ``actor`` and ``ref``
    sections are ``section`` (with its ``_target_`` actor-config class); returns the merged
    OmegaConf config and each of the two sections as verl converts it."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    base = OmegaConf.create({"actor_rollout_ref": {name: section for name in ("actor", "ref")}})
    path = Path(__file__).parents[2] / "configs" / "verl" / overlay
    merged = OmegaConf.merge(base, OmegaConf.load(path))
    return merged, {name: omega_conf_to_dataclass(merged.actor_rollout_ref[name])
                    for name in ("actor", "ref")}
