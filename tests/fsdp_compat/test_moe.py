"""Qwen3-MoE: the router's load-balancing loss of the shared forward equals the plain one's,
value and gradient, although shared prefix tokens are routed once."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.fsdp_compat import router_aux_loss, row_multiplicity, shared_forward
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import make_workload

from ._models import PRESET, plain_and_shared


def _router_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "gate" in n and p.grad is not None}


@pytest.mark.parametrize("workload", ["grpo", "tree"])
def test_the_router_loss_and_its_gradient_equal_the_plain_forward(workload):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    plain, shared = plain_and_shared("qwen3_moe")
    w = make_workload(workload, vocab_size=PRESET.vocab_size)
    config = plain.config
    # plain: every sequence alone, every token routed once per sequence holding it
    router_logits = [plain(input_ids=s[None], output_router_logits=True).router_logits
                     for s in w.sequences]
    per_layer = tuple(torch.cat(layer) for layer in zip(*router_logits))
    expected = load_balancing_loss_func(per_layer, config.num_experts, config.num_experts_per_tok)
    expected.backward()

    out = shared_forward(shared, w.sequences, PrefixSharingConfig(min_prefix_len=1))
    assert out.plan.has_sharing
    out.aux_loss.backward()
    torch.testing.assert_close(out.aux_loss, expected, rtol=1e-5, atol=0)
    plain_grads, shared_grads = _router_grads(plain), _router_grads(shared)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-5, atol=1e-7)


def test_each_flat_row_counts_once_per_sequence_reading_it():
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 9, 9]), torch.tensor([5, 6])]
    plan = build_plan(seqs, PrefixSharingConfig(min_prefix_len=1), pad_to_multiple_of=4)
    # rows 0-1 are read by all three sequences, row 2 by a and b; padding by nobody
    assert row_multiplicity(plan).tolist() == [3, 3, 2, 1, 1, 1, 0, 0]


def test_router_logits_of_another_layout_are_refused():
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 9])]
    plan = build_plan(seqs, PrefixSharingConfig(min_prefix_len=1))
    with pytest.raises(ValueError, match="T_flat=5"):
        router_aux_loss([torch.zeros(8, 4)], plan, num_experts=4, top_k=2)
