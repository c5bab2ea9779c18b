"""MoE router statistics with groups across micro-batches at TP=2 with sequence parallelism, in
verl's real Megatron engine (verl 0.9.1, two gloo ranks): why they once differed from verl's
stock step, and that they equal it where the two define the statistics alike.

verl's stock step packs each sample padded to a multiple of TP (``preprocess_thd_engine``) and
megatron's router keeps its statistics over every packed row, the pad rows included (a THD
input has no padding mask). Sharing keeps them over the samples' tokens only - megatron's stock
step on the padded batch with its padding mask, which the group driver is tested against - in
one micro-batch and across micro-batches alike. So on a batch whose samples all have a length
that is a multiple of TP, the cross step (the tiny MoE preset's aux + seq-aux + global-aux
losses and z-loss, full recompute) equals verl's stock step forced onto the same split: every
rank's old log-probs, entropy, loss per micro-batch and every gradient within 1e-5. On the same
batch with odd lengths both sharing paths - across micro-batches and in one micro-batch - differ
from it on the gradients by the pad rows' share of the statistics (the control).
"""

from __future__ import annotations

from functools import partial
from unittest import mock

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402

ONE_MICRO_BATCH = {"mode": "arbitrary_prefix", "min_prefix_len": 1}
RUNS = (("even", "cross"), ("odd", "cross"), ("odd", "one_micro_batch"))


def steps(rank: int) -> dict:
    """Per (lengths, sharing): the sharing step at a budget of 80 (its split recorded), then
    verl's stock step forced onto that split; gradients completed over the tensor-parallel
    group as megatron's finalize does."""
    import tests.verl_ext._batch as batches
    from tests.verl_ext._batch import plain_output, use_cpu_platform

    use_cpu_platform()
    import verl.workers.engine.utils as engine_utils
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.engines.megatron import finalize_sequence_parallel_grads
    from prefix_sharing.presets import PRESETS, sharp
    from tests.verl_ext._engine import actor_config, build_engine
    from tests.verl_ext.test_cross_forward import CROSS, RECOMPUTE, batch, same_split

    preset = sharp(PRESETS["tiny-moe"])
    workload = batches.make_workload

    def even(*args, **kwargs):  # each sample one token shorter where its length is odd
        made = workload(*args, **kwargs)
        made.sequences[:] = [s[: len(s) - len(s) % 2] for s in made.sequences]
        return made

    results = {}
    for lengths, sharing in RUNS:
        recorded, replayed = same_split(engine_utils.rearrange_micro_batches)
        for name, split in (("sharing", recorded), ("off", replayed)):
            prefix_grouper = {"cross": CROSS, "one_micro_batch": ONE_MICRO_BATCH}[sharing]
            config = actor_config(None if name == "off" else prefix_grouper, megatron=dict(
                tensor_model_parallel_size=2, sequence_parallel=True))
            engine = build_engine(config, preset=preset,
                                  spec=dict(num_experts=preset.num_experts,
                                            normalization="RMSNorm"),
                                  sequence_parallel=True, **RECOMPUTE["full"])
            with (mock.patch.object(engine_utils, "rearrange_micro_batches", split),
                  mock.patch.object(batches, "make_workload",
                                    even if lengths == "even" else workload)):
                infer = engine.infer_batch(batch(80))
                train = engine.forward_backward_batch(batch(80), partial(ppo_loss, config=config))
            finalize_sequence_parallel_grads(engine.module[0])
            grads = {n: p.grad.clone() for n, p in engine.module[0].named_parameters()}
            results[lengths, sharing, name] = {"infer": plain_output(infer),
                                               "train": plain_output(train), "grads": grads}
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(steps, 2, tp=2, timeout=900)


def test_across_micro_batches_equals_verls_stock_step_without_its_pad_rows(ranks):
    for rank, results in enumerate(ranks):
        cross = results["even", "cross", "sharing"]
        assert cross["train"]["metrics"]["prefix_sharing/prefix_recomputes_avoided"] == [4.0]
        same_outputs(cross, results["even", "cross", "off"], f"rank {rank} even lengths")


@pytest.mark.parametrize("sharing", ["cross", "one_micro_batch"])
def test_verls_pad_rows_in_the_statistics_are_the_difference(ranks, sharing):
    """Odd lengths: verl's stock step counts its pad rows; across micro-batches and in one
    micro-batch alike, sharing counts the samples' tokens only."""
    for rank, results in enumerate(ranks):
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(results["odd", sharing, "sharing"], results["odd", sharing, "off"],
                         f"rank {rank} odd lengths {sharing}")
