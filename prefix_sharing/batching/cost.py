"""The one cost model of batching: what a set of samples costs to compute, after sharing.

Both the micro-batch split and the data-parallel partitioner balance by it::

    cost = computed tokens + attended pairs / keys_per_token

*computed tokens* are the rows the plan of the set computes (``plan.num_tokens_unique``); the
*attended pairs* are, for each computed query, the keys it attends - bottom-right causal over
its full sequence, the shared prefix included (:func:`prefix_sharing.flops.attended_pairs`).
The first term stands for every linear layer, the second for attention; ``keys_per_token`` is
how many attended keys cost as much as one token's linear layers. The default, 12288, is
verl's ``calculate_workload`` (``24576 * L + L**2`` for a plain sequence of ``L`` tokens, a
7B model of hidden size 4096): a plain sequence costs ``L + L * (L + 1) / 24576``, which is
verl's workload over 24576 up to the ``L / 24576`` that counting the ``L * (L + 1) / 2``
causal pairs, not ``L**2 / 2``, adds. :meth:`CostModel.for_model` takes the ratio of a model
preset's FLOPs instead, and then the cost is that preset's forward FLOPs of the plan in units of one
token's linear layers (``tests/batching/test_cost.py`` checks it against ``count_flops``).

The cost is in token units, so it reads like the token budgets it is balanced under.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from ..config import PrefixSharingConfig
from ..errors import InputError
from ..flops import attended_pairs, flops_per_token_and_pair
from ..plan import SharingPlan
from ..planner import TokenSequence, build_plan, prompt_groups
from ..presets import ModelPreset

__all__ = ["CostModel", "Measure", "SubsetMeasure", "check_batch", "check_positive_int",
           "computed_cost"]

_VERL_KEYS_PER_TOKEN = 12288.0  # calculate_workload: 24576 per token, 1 per L**2 = 2 per pair


@dataclasses.dataclass(frozen=True)
class CostModel:
    """``cost = computed tokens + attended pairs / keys_per_token`` (see the module doc).

    Attributes:
        keys_per_token: attended (query, key) pairs that cost as much as one computed token;
            12288 (verl's ``calculate_workload``) by default.
    """

    keys_per_token: float = _VERL_KEYS_PER_TOKEN

    def __post_init__(self) -> None:
        if isinstance(self.keys_per_token, bool) or not self.keys_per_token > 0:
            raise InputError(f"CostModel.keys_per_token must be > 0; got {self.keys_per_token!r}")

    @classmethod
    def for_model(cls, model: ModelPreset) -> CostModel:
        """The ratio of ``model``'s forward FLOPs per token and per attended pair (all its
        attention layers together). Windowed attention is refused: its pairs are not
        every causal pair, and this model counts every one."""
        if model.window_size is not None:
            raise InputError(f"CostModel.for_model({model.name!r}): the cost model counts every "
                             "causal pair; sliding-window attention is not modelled")
        per_token, per_pair = flops_per_token_and_pair(model)
        return cls(keys_per_token=per_token / per_pair)

    def plain(self, length: int) -> float:
        """The cost of one sequence of ``length`` tokens computed alone."""
        return length + length * (length + 1) / 2 / self.keys_per_token


def computed_cost(plan: SharingPlan, cost_model: CostModel | None = None) -> float:
    """The cost of computing ``plan`` (see the module doc)."""
    cost_model = CostModel() if cost_model is None else cost_model
    return plan.num_tokens_unique + attended_pairs(plan) / cost_model.keys_per_token


class Measure(NamedTuple):
    """What a set of samples computes: tokens (what token budgets bound) and cost."""

    tokens: int
    cost: float


class SubsetMeasure:
    """Tokens and cost of any subset of a batch, its plan built alone (as a micro-batch or a
    rank would build it): with ``mode="prompt_only"`` its uid groups share their prompts."""

    def __init__(self, sequences: Sequence[TokenSequence], config: PrefixSharingConfig,
                 uids: Sequence[Hashable] | None, prompt_lens: Sequence[int] | None,
                 cost_model: CostModel | None = None) -> None:
        self.sequences, self.config = sequences, config
        self.uids, self.prompt_lens = uids, prompt_lens
        self.cost_model = CostModel() if cost_model is None else cost_model

    def __call__(self, members: Sequence[int]) -> int:
        """The tokens the subset's plan computes."""
        return self.measure(members).tokens

    def measure(self, members: Sequence[int]) -> Measure:
        if self.config.mode == "off":
            lengths = [len(self.sequences[i]) for i in members]
            return Measure(sum(lengths), sum(map(self.cost_model.plain, lengths)))
        plan = self.plan(members)
        return Measure(plan.num_tokens_unique, computed_cost(plan, self.cost_model))

    def plan(self, members: Sequence[int]) -> SharingPlan:
        groups = None
        if self.config.mode == "prompt_only":
            groups = prompt_groups([self.uids[i] for i in members],
                                   [self.prompt_lens[i] for i in members])
        return build_plan([self.sequences[i] for i in members], self.config, groups=groups)


def check_batch(who: str, n: int, config: PrefixSharingConfig,
                **per_sample: Sequence[object] | None) -> None:
    """The checks every batching entry point makes: a config, a non-empty batch, one value
    per sample in each ``per_sample`` list given, and uids plus prompt lengths for
    ``prompt_only`` (the shared prompt is known only per uid)."""
    if not isinstance(config, PrefixSharingConfig):
        raise TypeError(f"config must be a PrefixSharingConfig; got {type(config).__name__}")
    if n == 0:
        raise InputError(f"{who} needs at least one sequence; got an empty batch")
    for name, values in per_sample.items():
        if values is not None and len(values) != n:
            raise InputError(f"{len(values)} {name} for a batch of {n} sequences")
    if config.mode == "prompt_only" and (
        per_sample.get("uids") is None or per_sample.get("prompt_lens") is None
    ):
        raise InputError(
            "mode='prompt_only' shares uid groups' prompts: pass uids= and prompt_lens=")


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1; got {value!r}")
