"""token_stats over a vocabulary split across two real tensor-parallel ranks (gloo) gives the
log-probs, entropy and gradients of the input sequences run plainly.

The logits come from a toy causal model - a token's logits are its embedding plus its
position's - so the reference is computed from the input sequences alone (logits / T,
log-softmax, gather the next token), with no plan, restore or code of this package, and the
gradients are compared on the toy model's weights: each rank's vocabulary slice of the flat
logits' gradient is gathered and carried back to them.
"""

from __future__ import annotations

import torch

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
    embed = (torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * 3).requires_grad_()
    pos = torch.randn(max(map(len, seqs)), VOCAB, generator=g, dtype=torch.float64)
    pos.requires_grad_()
    flat = embed[mb.plan.input_ids] + pos[mb.plan.position_ids]  # the toy model on the plan
    full = flat.detach()
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
        # the flat logits' gradient, both vocabulary slices, carried back to the toy weights
        slices = [torch.empty_like(local.grad) for _ in range(2)]
        torch.distributed.all_gather(slices, local.grad.contiguous())
        got = torch.autograd.grad(flat, (embed, pos), torch.cat(slices, 1).double(),
                                  retain_graph=True)
        # the reference: every input sequence run plainly, in fp64
        ref_lp, ref_ent = _plain(embed, pos, seqs, temperature)
        ref_loss = (weights * ref_lp).sum()
        if with_entropy:
            ref_loss = ref_loss + (weights.flip(0) * ref_ent).sum()
        want = torch.autograd.grad(ref_loss, (embed, pos))
        results.append({
            "log_probs": (stats.log_probs.detach(), ref_lp.detach()),
            "entropy": (stats.entropy, ref_ent.detach()),
            "grad": (torch.cat([x.flatten() for x in got]),
                     torch.cat([x.flatten() for x in want])),
            "padding": mb.plan.num_padding,
            "all_reduces": (forward_all_reduces, len(all_reduces) - forward_all_reduces),
        })
    return results


def _plain(embed, pos, seqs, temperature):
    """Per input sequence: the toy model's logits / T, log-softmax, the next token's log-prob
    (0 at the last position, which predicts nothing) and the entropy."""
    log_probs, entropy = [], []
    for seq in seqs:
        logp = torch.log_softmax((embed[seq] + pos[: len(seq)]) / temperature, dim=-1)
        picked = logp[torch.arange(len(seq) - 1), seq[1:]]
        log_probs.append(torch.cat([picked, picked.new_zeros(1)]))
        entropy.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(log_probs), torch.cat(entropy)


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
