"""What to share, and with which attention kernel.

The config is deliberately small: it decides *which* prefixes are computed once (``mode``,
``min_prefix_len``, ``min_group_size``) and *which kernel* runs the attention (``backend``).
Everything else (the plan, the kernels' arguments) is derived from the token ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["PrefixSharingConfig", "MODES", "BACKENDS"]

Mode = Literal["arbitrary_prefix", "prompt_only", "off"]
Backend = Literal["auto", "torch", "flash_attn", "te", "npu", "flex"]

MODES: tuple[str, ...] = ("arbitrary_prefix", "prompt_only", "off")
BACKENDS: tuple[str, ...] = ("auto", "torch", "flash_attn", "te", "npu", "flex")


@dataclasses.dataclass(frozen=True)
class PrefixSharingConfig:
    """Which prefixes a micro-batch computes once.

    Attributes:
        mode: ``"arbitrary_prefix"`` shares every common prefix of any two sequences (GRPO
            prompts, step-wise chains, trees, agent turns); ``"prompt_only"`` shares only the
            prompt of explicit groups (verl's ``uid``), as PrefixGrouper does; ``"off"`` computes
            every token of every sequence (the identity plan).
        min_prefix_len: a prefix shorter than this is recomputed rather than shared. The default
            of 8 keeps one-token coincidences (a shared BOS, a chat-template header) from
            fragmenting the layout into many tiny segments that cost more than they save.
        min_group_size: a prefix is shared only when at least this many sequences hold it
            (the provider included). 2 shares every repeat.
        backend: attention kernel. ``"auto"`` picks flash-attn or TE on CUDA, the fused NPU
            kernel on Ascend, and the torch reference elsewhere. ``"flex"``: FlexAttention,
            the plan's tree as one masked call (never picked by ``"auto"``; not run on a GPU
            by this project yet).
        cross_micro_batch: when a group's computed tokens exceed the micro-batch token budget
            (verl's ``max_token_len_per_gpu``), compute its common prefix once and run its tails
            as consecutive micro-batches that read the prefix's K/V
            (:mod:`prefix_sharing.cross_micro_batch`), instead of cutting the group and
            recomputing the prefix in every piece. Off by default; the project's megatron
            group run and verl's engines (Megatron: the actor's and the critic's; FSDP:
            the actor's and the critic's, Ulysses included; not for recurrent layers,
            ``verl.cross_micro_batch.recurrent``). Which parallel
            layouts and model features run with it is docs/cross-micro-batch.md's (TP with
            sequence parallelism, CP, PP with interleaved stages, MoE router statistics,
            routing replay, activation recompute, windows); ``prefix-sharing preflight``
            reports the engine's refusals before a run.
        self_check: the first micro-batch that shares anything also runs verl's stock path
            on the same weights (without gradient) and the log-probs and entropy are compared:
            the figures are logged and reported, and beyond the dtype's bound the run stops
            (:mod:`prefix_sharing.self_check`). Off by default: it costs one more forward per
            engine; turn it on for a first run on new hardware or kernels.
    """

    mode: Mode = "arbitrary_prefix"
    min_prefix_len: int = 8
    min_group_size: int = 2
    backend: Backend = "auto"
    cross_micro_batch: bool = False
    self_check: bool = False

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        _check_int("min_prefix_len", self.min_prefix_len, minimum=1)
        _check_int("min_group_size", self.min_group_size, minimum=2)
        _check_choice("backend", self.backend, BACKENDS)
        _check_bool("cross_micro_batch", self.cross_micro_batch)
        _check_bool("self_check", self.self_check)
        if self.cross_micro_batch and self.mode == "prompt_only":
            raise ValueError("PrefixSharingConfig.cross_micro_batch=True plans with "
                             "mode='arbitrary_prefix'; mode='prompt_only' cannot use it")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @classmethod
    def from_verl(cls, actor_config: Mapping[str, Any] | Any) -> PrefixSharingConfig:
        """Builds the config from a verl actor config (a dict, OmegaConf node or dataclass).

        Reads ``use_prefix_grouper`` and the optional ``prefix_grouper`` block::

            actor_rollout_ref.actor:
              use_prefix_grouper: true
              prefix_grouper: {mode: arbitrary_prefix, min_prefix_len: 8, min_group_size: 2}

        ``use_prefix_grouper: true`` without a ``mode`` means ``"prompt_only"``, which is what
        verl's flag does on its own today. ``use_prefix_grouper: false`` (or absent) means
        ``"off"``. A whole trainer config is accepted too: its ``actor_rollout_ref.actor`` is read.
        """
        actor = _get(actor_config, "actor_rollout_ref")
        actor = _get(actor, "actor") if actor is not None else actor_config
        if actor is None:
            raise ValueError("from_verl: the config has actor_rollout_ref but no actor section")
        enabled = _get(actor, "use_prefix_grouper", False)
        if not isinstance(enabled, bool):
            raise ValueError(f"use_prefix_grouper must be true or false; got {enabled!r}")
        block = _get(actor, "prefix_grouper") or {}
        options = {key: _get(block, key) for key in _keys(block)}
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            allowed = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ValueError(f"prefix_grouper has unknown key(s) {unknown}; allowed: {allowed}")
        if not enabled:
            options["mode"] = "off"
        else:
            options.setdefault("mode", "prompt_only")
        return cls(**options)


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"PrefixSharingConfig.{field} must be one of {choices}; got {value!r}")


def _check_bool(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"PrefixSharingConfig.{field} must be true or false; got {value!r}")


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"PrefixSharingConfig.{field} must be an integer >= {minimum}; got {value!r}"
        )


def _get(node: Any, key: str, default: Any = None) -> Any:
    """Reads ``key`` from a mapping, an OmegaConf node or an attribute container."""
    if node is None:
        return default
    if isinstance(node, Mapping) or hasattr(node, "get"):
        return node.get(key, default)
    return getattr(node, key, default)


def _keys(node: Any) -> list[str]:
    if isinstance(node, Mapping) or hasattr(node, "keys"):
        return list(node.keys())
    if dataclasses.is_dataclass(node):
        return [f.name for f in dataclasses.fields(node)]
    return [k for k in vars(node) if not k.startswith("_")]
