"""The core equivalence check: the tiny decoder, plain and shared, on the same weights."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from ..attention import prefix_attention
from ..config import PrefixSharingConfig
from ..logprobs import token_log_probs
from ..plan import SharingPlan
from ..planner import PromptGroup, build_plan
from ..equivalence import Comparison, RunOutputs, advantages, compare_runs, plain_token_log_probs
from .tiny_decoder import TinyDecoder, TinyDecoderConfig

__all__ = ["TinyCheck", "check_tiny_decoder", "plain_run", "shared_run"]


def plain_run(model: TinyDecoder, sequences: list[torch.Tensor], weights: torch.Tensor) -> RunOutputs:
    """Each sequence on its own, standard causal attention, reference log-probs."""

    def forward():
        logits = model.forward_plain(sequences)
        return (logits, *plain_token_log_probs(logits, sequences))

    return RunOutputs.collect(model, forward, weights)


def shared_run(model: TinyDecoder, plan: SharingPlan, weights: torch.Tensor) -> RunOutputs:
    """The flat layout of ``plan``, K/V injection, log-probs gathered from the flat logits."""

    def attend(q, k, v):
        return prefix_attention(q, k, v, plan)

    def forward():
        flat = model(plan.input_ids, plan.position_ids, attend)
        stats = token_log_probs(flat, plan)
        return plan.restore(flat), stats.log_probs, stats.entropy

    return RunOutputs.collect(model, forward, weights)


@dataclasses.dataclass
class TinyCheck:
    plan: SharingPlan
    shared_vs_fp32: Comparison  # the shared run (in `dtype`) against the fp32 plain run
    plain_vs_fp32: Comparison | None  # the plain run in `dtype` against fp32 (None for fp32)


def check_tiny_decoder(
    sequences: Sequence[torch.Tensor],
    config: PrefixSharingConfig | None = None,
    *,
    groups: Sequence[PromptGroup] | None = None,
    pad_to_multiple_of: int = 1,
    dtype: torch.dtype = torch.float32,
    model_config: TinyDecoderConfig = TinyDecoderConfig(),
    seed: int = 0,
) -> TinyCheck:
    """Plain vs shared forward+backward of a seeded tiny decoder on ``sequences``.

    For a low-precision ``dtype`` the plain run is repeated in that dtype, so the shared run's
    error can be judged against the plain path's own rounding (flash-attn's rule).
    """
    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    torch.manual_seed(seed)
    model = TinyDecoder(model_config).to(dtype)
    reference = copy.deepcopy(model).float()  # same (rounded) weights, computed in fp32
    plan = build_plan(sequences, config, groups=groups, pad_to_multiple_of=pad_to_multiple_of)
    weights = advantages(plan.num_tokens_total, seed).masked_fill(plan.is_last_token, 0.0)

    ref32 = plain_run(reference, sequences, weights)
    shared = shared_run(model, plan, weights)
    plain_low = None if dtype == torch.float32 else plain_run(model, sequences, weights)
    return TinyCheck(
        plan=plan,
        shared_vs_fp32=_to_fp32_comparison(shared, ref32),
        plain_vs_fp32=None if plain_low is None else _to_fp32_comparison(plain_low, ref32),
    )


def _to_fp32_comparison(run: RunOutputs, ref32: RunOutputs) -> Comparison:
    as32 = RunOutputs(
        run.logits.float(), run.log_probs.float(), run.entropy.float(), run.loss.float(),
        {k: g.float() for k, g in run.grads.items()},
    )
    return compare_runs(as32, ref32)
