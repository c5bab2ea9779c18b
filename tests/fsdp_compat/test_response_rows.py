"""Only the LM-head rows that predict response tokens: the same response log-probs, entropy and
gradients as the full head, from fewer rows."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.config import PrefixSharingConfig
from prefix_sharing.fsdp_compat import shared_forward
from prefix_sharing.fsdp_compat.response_rows import response_rows
from prefix_sharing.planner import build_plan
from prefix_sharing.workloads import make_workload

from ._models import PRESET, plain_and_shared

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)


def _prompt_lens(workload):
    lens = {m: g.prompt_len for g in workload.groups for m in g.members}
    return [lens[i] for i in range(len(workload.sequences))]


def _loss(log_probs, entropy):
    weights = torch.linspace(0.5, 1.5, log_probs.numel())
    return -(weights * log_probs).mean() - 0.01 * entropy.mean()


@pytest.mark.parametrize("workload", ["grpo", "tree"])
def test_response_rows_give_the_full_heads_response_stats_and_gradients(workload):
    _, full = plain_and_shared("qwen2")
    _, kept = plain_and_shared("qwen2")
    w = make_workload(workload, vocab_size=PRESET.vocab_size)
    starts = _prompt_lens(w)

    ref = shared_forward(full, w.sequences, EVERY_PREFIX)
    spans = [slice(s - 1, n) for s, n in zip(starts, ref.plan.seq_lens)]
    ref_lp = torch.cat([x[sp] for x, sp in zip(ref.plan.split(ref.stats.log_probs), spans)])
    ref_ent = torch.cat([x[sp] for x, sp in zip(ref.plan.split(ref.stats.entropy), spans)])
    _loss(ref_lp, ref_ent).backward()

    out = shared_forward(kept, w.sequences, EVERY_PREFIX, response_starts=starts)
    _loss(out.stats.log_probs, out.stats.entropy).backward()

    assert out.logits.size(0) == out.response.num_tokens_flat < ref.plan.num_tokens_flat
    torch.testing.assert_close(out.stats.log_probs, ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.stats.entropy, ref_ent, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(kept.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_each_sequence_keeps_its_response_predictors_and_its_last_position():
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 9, 9])]
    plan = build_plan(seqs, EVERY_PREFIX)  # flat rows: 5 6 7 8 | 9 9
    rows = response_rows(plan, [3, 3])
    # a: positions 2, 3 (rows 2, 3); b: positions 2, 3, 4 (rows 2, 4, 5): row 2 is shared
    assert rows.rows.tolist() == [2, 3, 4, 5]
    assert rows.seq_lens == (2, 3)
    assert rows.next_token_ids.tolist() == [8, 0, 9, 9, 0]


@pytest.mark.parametrize("starts, message", [([3], "1 response starts for 2"),
                                             ([0, 3], "cannot start at 0"),
                                             ([3, 6], "sequence 1 has 5 tokens")])
def test_impossible_response_starts_are_refused(starts, message):
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7, 9, 9])]
    with pytest.raises(ValueError, match=message):
        response_rows(build_plan(seqs, EVERY_PREFIX), starts)
