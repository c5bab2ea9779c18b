"""The PrefixGrouper peer: on a GRPO batch, mode="prompt_only" gives PrefixGrouper's results on the
same model (response log-probs, entropy, every gradient) and computes the same tokens; on a
tree batch, arbitrary_prefix computes fewer tokens than any prompt-only grouping can."""

from __future__ import annotations

import copy

import pytest
import torch

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.equivalence import FP32_RTOL, max_rel_diff
from prefix_sharing.fsdp_compat import shared_forward
from prefix_sharing.fsdp_compat.prefix_grouper_peer import (PEER_ATTENTION_NAME, grouped_batch,
                                                            prefix_grouper_forward,
                                                            register_peer_attention)
from prefix_sharing.planner import PromptGroup, build_plan
from prefix_sharing.workloads import make_workload

from ._models import PRESET, plain_and_shared

PROMPT_ONLY = PrefixSharingConfig(mode="prompt_only")


def _peer(model):
    register_peer_attention()
    peer = copy.deepcopy(model)
    peer.set_attn_implementation(PEER_ATTENTION_NAME)
    return peer


def _response_loss(log_probs, entropy):
    lp, ent = torch.cat(log_probs), torch.cat(entropy)
    weights = torch.linspace(0.5, 1.5, lp.numel())
    return -(weights * lp).mean() - 0.01 * ent.mean()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_only_equals_prefix_grouper_on_a_grpo_batch(family):
    plain, shared = plain_and_shared(family)
    peer = _peer(plain)
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)

    theirs = prefix_grouper_forward(peer, w.sequences, w.groups)
    _response_loss(theirs.log_probs, theirs.entropy).backward()

    out = shared_forward(shared, w.sequences, PROMPT_ONLY, groups=w.groups)
    prompt_len = {m: g.prompt_len for g in w.groups for m in g.members}
    responses = [slice(prompt_len[i] - 1, len(s) - 1) for i, s in enumerate(w.sequences)]
    ours_lp = [lp[r] for lp, r in zip(out.plan.split(out.stats.log_probs), responses)]
    ours_ent = [e[r] for e, r in zip(out.plan.split(out.stats.entropy), responses)]
    _response_loss(ours_lp, ours_ent).backward()

    torch.testing.assert_close(torch.cat(ours_lp), torch.cat(theirs.log_probs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(ours_ent), torch.cat(theirs.entropy), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(shared.named_parameters(), peer.parameters(), strict=True):
        assert max_rel_diff(p.grad, q.grad) <= FP32_RTOL, name  # relative to the grad's scale


def test_prompt_only_computes_the_tokens_prefix_grouper_lays_out():
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    batch = grouped_batch(w.sequences, w.groups)
    plan = build_plan(w.sequences, PROMPT_ONLY, groups=w.groups)
    assert int(batch.grouper.total_lens.sum()) == plan.num_tokens_unique


def test_arbitrary_prefix_on_a_tree_computes_fewer_tokens_than_any_prompt_grouping():
    """Every way to split a tree batch into prompt groups (each sharing its members' longest
    common prefix, the most a prompt-only group can share) computes more tokens than
    arbitrary_prefix, which also shares the branches below the split."""
    w = make_workload("tree", vocab_size=PRESET.vocab_size, depth=2)  # 6 sequences
    arbitrary = build_plan(w.sequences, PrefixSharingConfig(min_prefix_len=1))
    any_prompt = PrefixSharingConfig(mode="prompt_only", min_prefix_len=1)
    fewest = min(build_plan(w.sequences, any_prompt, groups=groups).num_tokens_unique
                 for groups in _every_prompt_grouping(w.sequences))
    assert arbitrary.num_tokens_unique < fewest


def _every_prompt_grouping(sequences):
    """Every partition of the batch into groups, each group over its longest common prefix."""
    for partition in _partitions(list(range(len(sequences)))):
        yield [PromptGroup(_common_prefix_len([sequences[m] for m in part]), part)
               for part in partition]


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield partition[:i] + [[first, *partition[i]]] + partition[i + 1:]


def _common_prefix_len(sequences):
    n = min(len(s) for s in sequences)
    first = sequences[0]
    return next((i for i in range(n) if any(s[i] != first[i] for s in sequences)), n)


def test_a_model_not_switched_to_the_peer_attention_is_refused():
    plain, _ = plain_and_shared()
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    with pytest.raises(ValueError, match="register_peer_attention"):
        prefix_grouper_forward(plain, w.sequences, w.groups)


def test_sequences_outside_the_groups_are_refused():
    w = make_workload("grpo", vocab_size=PRESET.vocab_size)
    with pytest.raises(ValueError, match="exactly one prompt group"):
        grouped_batch(w.sequences, w.groups[:1])
