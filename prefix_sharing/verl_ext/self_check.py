"""``prefix_grouper.self_check``: the first sharing micro-batch also runs verl's stock path.

One :class:`FirstStepSelfCheck` per sharing engine (:class:`.engine.SharingEngineMixin` makes
it, and adds its figures to the step's metrics); each engine's forward calls :meth:`check`
once it has the shared outputs of a micro-batch, with a function that runs verl's stock path
on the same micro-batch: the FSDP engine's own ``prepare_model_inputs`` / model /
``prepare_model_outputs`` with the model's stock attention (:mod:`.fsdp`), the Megatron
engine's stock forward function (:func:`.mcore.shared_forward`).

When: once per engine, on the first micro-batch whose plan shares anything (one that shares
nothing runs the plain layout and proves nothing), in whichever call comes first - in verl's
step that is the old-log-prob pass (``infer_batch``) of the actor and of the reference model,
each of which is its own engine with its own model, so each is checked once. The figures are
logged once per engine (at WARNING, so verl's default log level shows them) and reach that
call's metrics (``prefix_sharing/self_check_*``); beyond the dtype's bound
(:mod:`prefix_sharing.self_check`) it raises :class:`~prefix_sharing.self_check.SelfCheckFailed`.

The stock run leaves the step as it was: it runs under ``torch.no_grad`` (no graph, no
gradient; megatron's MoE routers count tokens for expert bias and aux losses only with grad
enabled), after the shared forward, with the RNG states of the CPU and the current
accelerator put back afterwards, and nothing it returns reaches verl.
Where the stock run would not be verl's stock path on the same micro-batch, the engine
refuses the check at construction (:func:`self_check_problems`; the FSDP engine refuses a
model with switched recurrent layers, :mod:`.fsdp`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..refusals import Refused
from ..self_check import SelfCheckResult, compare_with_stock

__all__ = ["FirstStepSelfCheck", "self_check_problems"]

logger = logging.getLogger(__name__)


class FirstStepSelfCheck:
    """Whether an engine's self-check is still to run, and its figures once it has.

    Args:
        enabled: ``prefix_grouper.self_check``; when false, :meth:`check` never runs anything.
    """

    def __init__(self, enabled: bool) -> None:
        self.pending = enabled
        self.result: SelfCheckResult | None = None
        self._unreported: dict[str, float] = {}

    def check(self, plan: Any, shared: Mapping[str, Any], stock: Callable[[], Mapping[str, Any]],
              dtype: torch.dtype, read_from: Sequence[int] | None = None) -> None:
        """Runs ``stock()`` (verl's stock path on the micro-batch ``plan`` was built for) and
        compares its outputs with ``shared`` (from each sample's ``read_from`` position on), if
        the check is pending and ``plan`` shares something; logs the figures and raises beyond
        the bound."""
        if not self.pending or not plan.has_sharing:
            return
        self.pending = False  # once, whatever the outcome
        with torch.no_grad(), _rng_kept():
            reference = stock()
        self.result = compare_with_stock(shared, reference, dtype, read_from)
        self._unreported = self.result.as_metrics()
        logger.warning("%s", self.result.describe())
        self.result.raise_if_beyond()

    def pop_metrics(self) -> dict[str, list[float]]:
        """The figures not yet reported, as verl's one-element metric lists (then none)."""
        metrics = {key: [value] for key, value in self._unreported.items()}
        self._unreported = {}
        return metrics


def self_check_problems(engine_config: Any) -> list[Refused]:
    """The engine settings under which the stock run would not be verl's stock path on the same
    micro-batch (the Megatron engine's; the FSDP engine has none of them):

    - ``pipeline_model_parallel_size > 1``: a later stage's stock run would read the previous
      stage's shared activations;
    - ``context_parallel_size > 1``: the stock run's zigzag split would reach the sharing core
      attention, whose context-parallel path expects the plan's split;
    - ``router_replay``: the routers hold the shared layout's routes to replay, or record them.
    """
    found = []
    for setting in ("pipeline_model_parallel_size", "context_parallel_size"):
        size = getattr(engine_config, setting, 1)
        if size > 1:
            found.append(Refused("verl.self_check.layout",
                                 f"self_check=true with {setting}={size}"))
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    if mode != "disabled":
        found.append(Refused("verl.self_check.layout", f"self_check=true with router_replay.mode="
                             f"{mode!r}"))
    return found



@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Puts the CPU's and the current accelerator's RNG states back after the block."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
