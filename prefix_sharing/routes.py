"""Recorded MoE routes for routing-replay checks, as a rollout engine would hand them over.

A batch-invariant engine records, for every token, a route that depends on the token's prefix
alone, so token-identical prefixes carry identical routes (:func:`recorded_routes`). Real
engines are not batch-invariant: :func:`diverge_inside_shared_prefix` changes one token's route
inside a shared prefix of one sequence, which the planner must then stop sharing at.

Routes are deliberately not the model's own top-k: replaying them changes what the model
computes, so a check that passes shows the routes were replayed, row by row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from .config import PrefixSharingConfig
from .planner import PromptGroup, build_plan

__all__ = ["recorded_routes", "diverge_inside_shared_prefix"]


def recorded_routes(sequences: Sequence[torch.Tensor], moe_layers: int, topk: int,
                    num_experts: int, seed: int = 0) -> list[torch.Tensor]:
    """One ``[L_i, moe_layers, topk]`` int64 tensor per sequence: for each token and MoE layer,
    ``topk`` distinct experts drawn from a generator seeded by the token's whole prefix."""
    if not 0 < topk <= num_experts:
        raise ValueError(f"topk must lie in [1, num_experts={num_experts}]; got {topk}")
    out = []
    for seq in sequences:
        ids = torch.as_tensor(seq).to("cpu", torch.int64).numpy()
        rows = np.empty((ids.size, moe_layers, topk), dtype=np.int64)
        digest = hashlib.blake2b(str(seed).encode(), digest_size=8)
        for j, token in enumerate(ids.tolist()):
            digest.update(token.to_bytes(8, "little"))  # the prefix up to token j
            rng = np.random.default_rng(int.from_bytes(digest.copy().digest(), "little"))
            for layer in range(moe_layers):
                rows[j, layer] = rng.permutation(num_experts)[:topk]
        out.append(torch.from_numpy(rows))
    return out


def diverge_inside_shared_prefix(
    sequences: Sequence[torch.Tensor], routes: Sequence[torch.Tensor], num_experts: int,
    config: PrefixSharingConfig = PrefixSharingConfig(),
    groups: Sequence[PromptGroup] | None = None,
) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """``routes`` with one token's route changed (on the first MoE layer: one expert swapped for
    one it did not use) in the middle of the longest prefix any sequence shares by its tokens;
    returns the new routes and that ``(sequence, position)``. ``groups``: for
    ``mode="prompt_only"``."""
    plan = build_plan(sequences, config, groups=groups)
    reader = int(np.argmax(plan.prefix_lens))
    shared = plan.prefix_lens[reader]
    if shared == 0:
        raise ValueError("no sequence shares a prefix under this config: nothing to diverge in")
    position = shared // 2
    out = [r.clone() for r in routes]
    route = out[reader][position, 0]
    unused = [e for e in range(num_experts) if e not in route.tolist()]
    if not unused:
        raise ValueError(f"every one of the {num_experts} experts is in the route; no swap")
    route[0] = unused[0]
    return out, (reader, position)
