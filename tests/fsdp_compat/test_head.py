"""install_hidden_state_head: a HuggingFace model that returns log-probs and entropy from its
hidden states gives what its own logits give, and is its own model without a request."""

import copy

import pytest
import torch

from prefix_sharing.fsdp_compat import enable_prefix_sharing, model_kwargs
from prefix_sharing.fsdp_compat.head import (HEAD_KWARG, HeadOutput, HeadRequest, head_problem,
                                             install_hidden_state_head)
from prefix_sharing.head_logprobs import read_positions
from prefix_sharing.logprobs import token_log_probs
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import make_workload

from ._models import EVERY_PREFIX, PRESET, plain_and_shared


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_head_request_gives_the_logits_results_in_the_read_window(family):
    _, logits_model = plain_and_shared(family)
    head_model = install_hidden_state_head(copy.deepcopy(logits_model))
    seqs = make_workload("grpo", vocab_size=PRESET.vocab_size).sequences
    plan = build_plan(seqs, EVERY_PREFIX)
    read_from = [len(s) // 2 for s in seqs]
    read = torch.zeros(plan.num_tokens_total, dtype=torch.bool)
    read[read_positions(plan, read_from)] = True
    kwargs = model_kwargs(plan)
    ref = token_log_probs(logits_model(**kwargs).logits[0], plan, temperature=0.8)
    out = head_model(**kwargs, **{HEAD_KWARG: HeadRequest(plan, 0.8, read_from=read_from,
                                                          chunk_rows=5)})
    assert isinstance(out, HeadOutput)
    torch.testing.assert_close(out.log_probs, ref.log_probs * read, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy, ref.entropy * read, rtol=1e-5, atol=1e-6)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    ((ref.log_probs * read).sum() + (ref.entropy * read).sum()).backward()
    for (name, a), b in zip(head_model.named_parameters(), logits_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    # without a request: the model's own forward, logits and all
    again = head_model(**kwargs).logits
    torch.testing.assert_close(again, logits_model(**kwargs).logits)


def test_a_transformed_head_is_named_unless_verl_fused_kernels_skip_the_transform():
    plain, _ = plain_and_shared("llama")
    assert head_problem(plain) is None
    plain.config.logits_scaling = 4.0
    assert head_problem(plain) == "it transforms its final logits (logits_scaling=4.0)"
    assert head_problem(plain, ignore_logit_transform=True) is None
    with pytest.raises(ValueError, match=r"logits_scaling=4.0\); score its logits instead"):
        install_hidden_state_head(enable_prefix_sharing(plain))
