"""A CPU stand-in for verl's fused ``linear_cross_entropy`` (``verl.utils.kernel``, Triton),
which verl's Megatron engine calls under ``use_fused_kernels: true``, written from its documented
semantics: ``hidden`` ``(N, hidden)`` (or ``(..., hidden)``), this tensor-parallel rank's vocabulary
slice of the head ``weight`` ``(V_local, hidden)``, ``labels`` ``(N,)`` as global token ids,
``temperature``, ``reduction="none"``, the tensor-parallel ``group``: per row, the log-prob of
its label and the entropy of ``softmax(hidden @ W.T / temperature)`` over the whole vocabulary,
in fp32. Gradients, as the kernel's backward gives them: each rank's ``d_weight`` and ``d_hidden``
through its own slice only (no reduction: under sequence parallelism the gather in front of the
kernel reduce-scatters ``d_hidden`` over the group).

:func:`installed` swaps it into ``verl.models.mcore.model_forward_fused`` and counts the calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none", group=None):
    assert reduction == "none"
    hidden = hidden.reshape(-1, hidden.size(-1)).float()
    logits = hidden @ weight.float().T  # this rank's slice: the only one that carries gradients
    if group is not None and torch.distributed.get_world_size(group) > 1:
        parts = [torch.empty_like(weight) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, weight.detach().contiguous(), group=group)
        rank = torch.distributed.get_rank(group)
        logits = torch.cat([logits if i == rank else hidden.detach() @ part.float().T
                            for i, part in enumerate(parts)], dim=-1)
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    log_probs = log_p.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, entropy


@contextlib.contextmanager
def installed() -> Iterator[list[int]]:
    """The stand-in in verl's fused forward module for the block; yields a list that grows
    by one per call."""
    from verl.models.mcore import model_forward_fused

    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return linear_cross_entropy(*args, **kwargs)

    saved = model_forward_fused.linear_cross_entropy
    model_forward_fused.linear_cross_entropy = counted
    try:
        yield calls
    finally:
        model_forward_fused.linear_cross_entropy = saved
