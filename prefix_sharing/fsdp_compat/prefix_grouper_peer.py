"""PrefixGrouper (the ``prefix-grouper`` package) on a HuggingFace model: the prompt-only peer.

PrefixGrouper lays each prompt group out as one padded row, ``[prompt | response_1 | ... ]``,
positions restarting at the prompt length for every response, and splits each attention call in
two: the prompts over themselves, then every response over its prompt and itself. This module
runs it the way its README shows, through a transformers attention function of its own, so the
benchmark and the tests can set it beside ``mode="prompt_only"`` on the same model and weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..planner import PromptGroup

__all__ = ["PEER_ATTENTION_NAME", "register_peer_attention", "GroupedBatch", "grouped_batch",
           "ResponseStats", "prefix_grouper_forward"]

PEER_ATTENTION_NAME = "prefix_grouper"
_GROUPER_KWARG = "prefix_grouper"


def register_peer_attention() -> None:
    """Makes ``attn_implementation="prefix_grouper"`` available (no mask function, as for ours)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PEER_ATTENTION_NAME, _grouped_attention)


def _grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' signature; q ``[G, h, S, d]``, k/v ``[G, h_kv, S, d]`` -> ``[G, S, h, d]``."""
    grouper = kwargs[_GROUPER_KWARG]
    return grouper.forward(_padded_causal_attention, query, key, value, scaling=scaling), None


def _padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             valid: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """PrefixGrouper's per-part attention: ``valid`` ``[b, L]`` marks real keys; queries are the
    last ``s`` of the ``L`` key slots (bottom-right causal). Pad queries attend to every key,
    so no softmax row is empty (their outputs are dropped by PrefixGrouper)."""
    s, L = q.size(2), k.size(2)
    causal = torch.ones(s, L, dtype=torch.bool, device=q.device).tril_(L - s)
    mask = (causal & valid[:, None, :]) | ~valid[:, L - s:, None]  # [b, s, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scaling,
                                         enable_gqa=q.size(1) != k.size(1))
    return out.transpose(1, 2)  # [b, s, h, d]


@dataclasses.dataclass
class GroupedBatch:
    """One padded row per prompt group, and the PrefixGrouper that knows the layout."""

    input_ids: torch.Tensor  # [G, max_total_len]
    position_ids: torch.Tensor  # [G, max_total_len]
    grouper: Any  # prefix_grouper.PrefixGrouper
    prompt_lens: list[int]  # per sequence, in the given order
    order: list[int]  # the sequences in grouped (group, member) order


def grouped_batch(sequences: Sequence[torch.Tensor], groups: Sequence[PromptGroup],
                  device: Any = "cpu") -> GroupedBatch:
    """PrefixGrouper's input layout of ``sequences`` grouped by ``groups`` (every sequence in
    exactly one group; each member keeps at least one response token)."""
    from prefix_grouper import PrefixGrouper

    members = [m for g in groups for m in g.members]
    if sorted(members) != list(range(len(sequences))):
        raise ValueError("PrefixGrouper needs every sequence in exactly one prompt group")
    prompt_lens = [0] * len(sequences)
    rows, positions, group_info = [], [], []
    for g in groups:
        prompt = sequences[g.members[0]][: g.prompt_len]
        tails = [sequences[m][g.prompt_len:] for m in g.members]
        if any(len(t) == 0 for t in tails):
            raise ValueError("PrefixGrouper needs at least one response token per sequence")
        for m in g.members:
            prompt_lens[m] = g.prompt_len
        rows.append(torch.cat([prompt, *tails]))
        positions.append(torch.cat([torch.arange(g.prompt_len)]
                                   + [g.prompt_len + torch.arange(len(t)) for t in tails]))
        group_info.append([g.prompt_len, *(len(t) for t in tails)])
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, p) in enumerate(zip(rows, positions)):
        input_ids[i, : len(r)], position_ids[i, : len(p)] = r, p
    grouper = PrefixGrouper(group_info, device=device)
    return GroupedBatch(input_ids.to(device), position_ids.to(device), grouper, prompt_lens,
                        members)


@dataclasses.dataclass
class ResponseStats:
    """Per sequence (given order), the log-probs of its response tokens and the entropy of the
    distributions that predict them: ``len(sequence) - prompt_len`` values each."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor]


def prefix_grouper_forward(model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                           groups: Sequence[PromptGroup], batch: GroupedBatch | None = None
                           ) -> ResponseStats:
    """The grouped forward (``model`` on the ``prefix_grouper`` attention) and the response
    log-probs, read from PrefixGrouper's ``split_output`` as its users do."""
    if getattr(model.config, "_attn_implementation", None) != PEER_ATTENTION_NAME:
        raise ValueError("call register_peer_attention() and "
                         "model.set_attn_implementation('prefix_grouper') first")
    device = model.get_input_embeddings().weight.device
    batch = grouped_batch(sequences, groups, device) if batch is None else batch
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                   **{_GROUPER_KWARG: batch.grouper}).logits
    # suffix rows: [prompt's last token | response], so row j predicts response token j
    _, _, suffix, _ = batch.grouper.split_output(logits, include_prefix_last=1)
    log_probs, entropy = [None] * len(sequences), [None] * len(sequences)
    for row, seq_index in enumerate(batch.order):
        target = sequences[seq_index][batch.prompt_lens[seq_index]:].to(device)
        logp = torch.log_softmax(suffix[row, : len(target)].float(), dim=-1)
        log_probs[seq_index] = logp.gather(1, target[:, None]).squeeze(1)
        entropy[seq_index] = -(logp.exp() * logp).sum(-1)
    return ResponseStats(log_probs, entropy)
