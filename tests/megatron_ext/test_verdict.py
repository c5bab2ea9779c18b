"""``verify``'s verdict on the Megatron engine: quiet on correct code at scale, loud on bugs.

The shared fp32 run is judged against megatron's stock model run again in float64 on the same
weights: it may be no further from that than 2x (grads 3x) the plain fp32 run is. Correct code
passes on a large batch with many reusers; four small bugs of the kind prefix sharing invites
- a reuser's rotary offset one position off, one reuser reading one wrong provider row, the
gathered K/V cut from the graph (reusers' gradients never reach the prefix), a softmax scale
off by 1e-3 - fail, even on a small batch. On the sharp test model (attention far from
uniform) each bug that changes the forward moves the entropy and log-probs by at least 10x the
fixed fp32 tolerance, and the loss too except for the 1e-3 softmax scale (see ``LOSS_BLIND``);
each bug's figures are printed (``pytest -s``) next to the tolerances. A shared run that loses a
micro-batch's outputs fails ``verify`` outright.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.engines.launch import RankError
from prefix_sharing.engines.verify import VerifyRequest, summarize, verify_job
from prefix_sharing.equivalence import FP32_RTOL
from prefix_sharing.plan import SharingPlan
from prefix_sharing.workloads import make_workload

from ._distributed import PRESET, run_distributed

CONFIG = PrefixSharingConfig(min_prefix_len=1)
# 18 agent episodes (2 tasks x 3 turns x 3 branches) under one 128-token system prompt: 9.9k
# tokens, 5.5k computed; every turn's prefix is read by up to 9 episodes.
LARGE_AGENT = dict(num_tasks=2, num_turns=3, branching=3, system_len=128, task_len=(16, 64),
                   turn_len=(32, 96))


# ----------------------------------------------------------------------------- the bugs
def _reusers(plan: SharingPlan) -> np.ndarray:
    """Per flat row: does it belong to a segment that reads a prefix from another sequence?"""
    q, kv = plan.cu_seqlens_q.cpu().numpy(), plan.cu_seqlens_kv.cpu().numpy()
    reads = (kv[1:] - kv[:-1]) > (q[1:] - q[:-1])
    return np.repeat(reads, q[1:] - q[:-1])


def _rope_off_by_one() -> None:
    """Reusers' tails rotated one position early (their tail starting at ``prefix_len - 1``;
    one late would run past the rotary table on the longest sequence)."""
    from prefix_sharing.megatron_ext import packed_seq

    build_plan = packed_seq.build_plan

    def shifted(*args, **kwargs):
        plan = build_plan(*args, **kwargs)
        offset = torch.from_numpy(_reusers(plan).astype(np.int64))
        return dataclasses.replace(plan, position_ids=plan.position_ids - offset)

    packed_seq.build_plan = shifted


def _wrong_provider_row() -> None:
    """The first reuser's last prefix key is read from the provider row one position earlier
    (an off-by-one in where one segment's prefix keys live), in both places attention reads
    them from: the gather index and the runs the key sources are laid out from - so the bug
    reaches whichever execution ``prefix_attention`` chooses."""
    from prefix_sharing.megatron_ext import packed_seq

    build_plan = packed_seq.build_plan

    def misread(*args, **kwargs):
        plan = build_plan(*args, **kwargs)
        q, kv = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist()
        reuser = next(i for i in range(len(q) - 1) if kv[i + 1] - kv[i] > q[i + 1] - q[i])
        last_prefix_key = kv[reuser + 1] - (q[reuser + 1] - q[reuser]) - 1
        index = plan.kv_gather_index.clone()
        index[last_prefix_key] = index[last_prefix_key - 1]
        runs = list(plan.prefix_runs_host)  # one run per prefix row read, the wrong one too
        prefix_rows = index[kv[reuser] : last_prefix_key + 1].tolist()
        runs[reuser] = tuple((row, row + 1) for row in prefix_rows)
        return dataclasses.replace(plan, kv_gather_index=index, prefix_runs_host=tuple(runs))

    packed_seq.build_plan = misread


def _kv_gradient_dropped() -> None:
    """The prefix rows a reuser reads are detached: its gradient never reaches the provider."""
    from prefix_sharing.attention import varlen_attention
    from prefix_sharing.megatron_ext import core_attention

    def attention(q, k, v, plan, *, softmax_scale=None, stored=(), **kernel_options):
        assert not stored, "the verdict's batches run in one micro-batch: nothing is stored"
        cu_q, cu_kv = plan.cu_seqlens_q.cpu().numpy(), plan.cu_seqlens_kv.cpu().numpy()
        tails, keys = cu_q[1:] - cu_q[:-1], cu_kv[1:] - cu_kv[:-1]
        own = np.concatenate([np.arange(n) >= n - s for n, s in zip(keys, tails)])
        own = torch.from_numpy(own)[:, None, None]
        index = plan.kv_gather_index
        k = torch.where(own, k.index_select(0, index), k.detach().index_select(0, index))
        v = torch.where(own, v.index_select(0, index), v.detach().index_select(0, index))
        return varlen_attention(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_kv,
                                plan.max_seqlen_q, plan.max_seqlen_kv, softmax_scale,
                                **kernel_options)

    core_attention.prefix_attention = attention


def _softmax_scale_off() -> None:
    """The shared path's softmax scale 1e-3 too large."""
    from prefix_sharing.megatron_ext import core_attention

    prefix_attention = core_attention.prefix_attention

    def attention(q, k, v, plan, *, softmax_scale=None, **kernel_options):
        scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
        return prefix_attention(q, k, v, plan, softmax_scale=scale * (1 + 1e-3), **kernel_options)

    core_attention.prefix_attention = attention


def _outputs_dropped() -> None:
    """The shared run loses its last micro-batch's outputs (log-probs, entropy, loss)."""
    from prefix_sharing.engines import megatron

    forward_backward = megatron.forward_backward

    def lossy(model, batches, layout, *args, **kwargs):
        run = forward_backward(model, batches, layout, *args, **kwargs)
        if layout == "shared":
            run.outputs.pop()
        return run

    megatron.forward_backward = lossy


BUGS = {"rope_off_by_one": _rope_off_by_one, "wrong_provider_row": _wrong_provider_row,
        "kv_gradient_dropped": _kv_gradient_dropped, "softmax_scale_off": _softmax_scale_off}
# bugs of the backward only: the forward (loss, entropy) is right, the gradients are not
BACKWARD_ONLY = {"kv_gradient_dropped"}
# A softmax scale 1e-3 off moves each log-prob by up to 7e-4 both ways; in the loss, a weighted
# mean over tokens, those moves largely cancel (3.5e-6): the one bug a loss-only check misses.
# The verdict still fails it on every other quantity (and on the loss: 7x its allowance).
LOSS_BLIND = {"softmax_scale_off"}
# a bug must move these by this many times the fixed fp32 tolerance
POWER = 10.0


# ----------------------------------------------------------------------------- jobs
def _verify(rank: int, bug: str | None, request: VerifyRequest) -> list:
    if bug is not None:
        {**BUGS, "outputs_dropped": _outputs_dropped}[bug]()  # in this spawned rank only
    return verify_job(rank, request)


def _verdict(workload: dict, bug: str | None = None, steps: int = 1) -> dict:
    w = make_workload("agent", vocab_size=PRESET.vocab_size, **workload)
    request = VerifyRequest([(w.sequences, None)], CONFIG, PRESET, steps=steps)
    return summarize(run_distributed(_verify, 1, bug, request, timeout=600), 0, torch.float32)


def test_a_large_batch_with_many_reusers_passes():
    report = _verdict(LARGE_AGENT)
    assert report["passed"], report
    assert report["reference_dtype"] == "float64"
    # the plain fp32 run's own error is measured, and is what the allowance scales
    assert all(report["plain_max_rel_diff"][q] > 0 for q in ("logits", "grads"))
    assert all(report["max_rel_diff"][q] <= report["allowed_rel_diff"][q]
               for q in report["max_rel_diff"])


@pytest.fixture(scope="module")
def bug_reports() -> dict[str, dict]:
    reports = {bug: _verdict({}, bug) for bug in BUGS}
    print(f"\ninjected bugs, tiny sharp agent batch, fp32: relative difference from the plain "
          f"run in float64 (fixed tolerance {FP32_RTOL:.0e}; allowed: the verdict's bound)")
    columns = ("loss", "entropy", "log_probs", "grads")
    print(f"{'':<22}" + "".join(f"{q:>10}" for q in columns) + "  allowed: "
          + "".join(f"{q:>10}" for q in columns))
    for bug, r in reports.items():
        d, a = r["max_rel_diff"], r["allowed_rel_diff"]
        print(f"{bug:<22}" + "".join(f"{d[q]:>10.1e}" for q in columns) + " " * 11
              + "".join(f"{a[q]:>10.1e}" for q in columns))
    return reports


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_bug_fails_the_verdict(bug, bug_reports):
    report = bug_reports[bug]
    failed = [q for q, ok in report["within_tolerance"].items() if not ok]
    assert not report["passed"] and "grads" in failed, report
    assert report["max_rel_diff"]["grads"] >= POWER * FP32_RTOL, report


@pytest.mark.parametrize("bug", sorted(set(BUGS) - BACKWARD_ONLY))
def test_a_forward_bug_moves_the_loss_and_the_entropy_far_beyond_the_tolerance(bug, bug_reports):
    """Not only the gradients: on the sharp model a check of the loss alone sees the bug."""
    moved = bug_reports[bug]["max_rel_diff"]
    assert all(moved[q] >= POWER * FP32_RTOL for q in ("entropy", "log_probs")), moved
    if bug not in LOSS_BLIND:
        assert moved["loss"] >= POWER * FP32_RTOL, moved
    assert not bug_reports[bug]["within_tolerance"]["loss"], moved


def test_a_backward_bug_leaves_the_forward_exact(bug_reports):
    """The control: dropping K/V gradients changes nothing but the gradients."""
    for bug in BACKWARD_ONLY:
        report = bug_reports[bug]
        assert all(report["within_tolerance"][q] for q in ("loss", "entropy", "log_probs")), report


def test_a_shared_run_that_loses_a_micro_batch_fails_verify():
    with pytest.raises(RankError, match="outputs of 0 vs 1 micro-batches"):
        _verdict({}, "outputs_dropped")
