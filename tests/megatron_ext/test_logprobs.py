"""token_stats over a vocabulary split across two real tensor-parallel ranks (gloo) gives the
whole-vocabulary log-probs, entropy and gradients.

No model: both ranks take their slice of the same seeded logits, so the comparison isolates the
vocab-parallel reductions (forward) and the communication-free backward.
"""

from __future__ import annotations

import torch

from prefix_sharing.equivalence import plain_token_log_probs

from ._distributed import run_distributed
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

VOCAB = 64  # 32 per rank
CASES = [  # temperature, with_entropy, chunk rows
    (1.0, True, None),
    (0.7, True, 3),
    (1.0, False, 3),
]


def _job(rank: int) -> list[dict]:
    from prefix_sharing import logprobs
    from prefix_sharing.megatron_ext import prepare_micro_batch, token_stats

    seqs = [s % VOCAB for batch in micro_batches(["grpo", "tree"]) for s in batch]
    mb = prepare_micro_batch(seqs, SHARE_EVERY_PREFIX, device="cpu")  # padded to 2 rows
    g = torch.Generator().manual_seed(0)
    full = torch.randn(mb.plan.num_tokens_flat, VOCAB, generator=g, dtype=torch.float64) * 3
    weights = torch.rand(mb.plan.num_tokens_total, generator=g)
    half = VOCAB // 2
    all_reduces = _count_all_reduces()
    results = []
    for temperature, with_entropy, chunk_rows in CASES:
        if chunk_rows is not None:
            logprobs.CHUNK_ELEMENTS = chunk_rows * half
        local = full[:, rank * half:(rank + 1) * half].float().requires_grad_()
        all_reduces.clear()
        stats = token_stats(local[None], mb, temperature=temperature, with_entropy=with_entropy)
        forward_all_reduces = len(all_reduces)
        loss = (weights * stats.log_probs).sum()
        if with_entropy:
            loss = loss + (weights.flip(0) * stats.entropy).sum()
        loss.backward()
        # the reference: the plain per-sequence computation over the whole vocabulary, in fp64
        whole = full.clone().requires_grad_()
        ref_lp, ref_ent = plain_token_log_probs(mb.plan.restore(whole).double() / temperature,
                                                mb.plan.split(mb.plan.token_ids))
        ref_loss = (weights * ref_lp).sum()
        if with_entropy:
            ref_loss = ref_loss + (weights.flip(0) * ref_ent).sum()
        ref_loss.backward()
        results.append({
            "log_probs": (stats.log_probs.detach(), ref_lp.detach()),
            "entropy": (stats.entropy, ref_ent.detach()),
            "grad": (local.grad, whole.grad[:, rank * half:(rank + 1) * half]),
            "padding": mb.plan.num_padding,
            "all_reduces": (forward_all_reduces, len(all_reduces) - forward_all_reduces),
        })
    return results


def _count_all_reduces() -> list:
    """Makes ``torch.distributed.all_reduce`` (in this spawned rank only) note every call."""
    calls, real = [], torch.distributed.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return real(*args, **kwargs)

    torch.distributed.all_reduce = counting
    return calls


def test_split_vocabulary_equals_the_whole_vocabulary_on_two_ranks():
    ranks = run_distributed(_job, 2, tp=2, timeout=300)
    for rank, results in enumerate(ranks):
        for (temperature, with_entropy, _), r in zip(CASES, results):
            case = f"rank {rank}, temperature {temperature}, entropy {with_entropy}"
            got, want = r["log_probs"]
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=case)
            got, want = r["entropy"]
            if with_entropy:
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=case)
            else:
                assert got is None, case
            got, want = r["grad"]
            assert got.abs().sum() > 0, case
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6, msg=case)
            assert r["all_reduces"] == (2, 0), case  # max and sum forward, nothing backward
    assert ranks[0][0]["padding"] > 0  # the pad segment is in the plan
