"""Interleaved (virtual) pipeline stages: each model chunk runs every micro-batch with its plan.

megatron's interleaved schedule runs chunk 0 of micro-batches 0..PP-1, then chunk 1 of the same,
each chunk at its own times; the plan rides in each forward's ``PackedSeqParams``, and each
chunk draws its micro-batches from its own iterator (:func:`~prefix_sharing.engines.megatron.
chunk_iterators`). The models take ``overlap_p2p_comm=True, batch_p2p_comm=False`` (verl's and
Megatron-LM's setting under virtual stages): without it, at PP=2, megatron's schedule handed a
stage another micro-batch's gradient as its activation - the "mislaid plan" that kept virtual
stages refused (refused by name now: ``tests/megatron_ext/test_checks.py``).

One spawned job, TP=2 x PP=2 x VPP=2 (4 gloo ranks), 4 micro-batches (GRPO, GRPO in reverse
order, a tree, the tree in reverse order): the shared step's log-probs, entropy, loss, logits
and every gradient (per chunk, TP-gathered) equal the plain packed step's on the same weights,
fp32 1e-5 - with even chunks (4 layers, one per chunk), an uneven
``pipeline_model_parallel_layout`` (the first chunk holds the embedding and two layers, the last
chunk only the final norm and head) and an uneven first stage
(``num_layers_in_first_pipeline_stage``: 2 layers of 6).

Control: each later chunk handed its neighbour micro-batch's plan (micro-batches 0 and 1, 2 and
3 swapped: the same flat token count, different rows) must come out different.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from prefix_sharing.engines import megatron as harness
from prefix_sharing.engines.megatron import compare, forward_backward, model_chunks
from prefix_sharing.equivalence import FP32_RTOL

from ._distributed import PRESET, run_distributed
from ._equivalence import SHARE_EVERY_PREFIX, micro_batches

FOUR_LAYERS = dataclasses.replace(PRESET, num_layers=4)
P2P = dict(overlap_p2p_comm=True, batch_p2p_comm=False)
# name: TransformerConfig overrides of the 4-layer model at PP=2 x VPP=2
CASES = {
    "even": {},
    # the virtual stages in order: (rank 0, chunk 0), (rank 1, chunk 0), (rank 0, chunk 1),
    # (rank 1, chunk 1)
    "uneven_layout": dict(pipeline_model_parallel_layout="Ett|t|t|L"),
    # six layers: one per chunk on the first stage, two per chunk on the last (setting the last
    # stage's too leaves no middle stage at PP=2, where megatron-core's layer offset divides
    # by zero under virtual stages)
    "uneven_first": dict(num_layers=6, num_layers_in_first_pipeline_stage=2),
}


def batches() -> list[list[torch.Tensor]]:
    """GRPO and tree micro-batches, each followed by its sequences in reverse order: the same
    flat token count under a different flat layout, so a chunk handed its neighbour's plan
    runs without a shape error and must be caught by the comparison."""
    grpo, tree = micro_batches(["grpo", "tree"])
    return [grpo, grpo[::-1], tree, tree[::-1]]


def _previous_plans(inputs, chunks):
    """The control: every chunk after the first reads micro-batch i's activations with the
    plan of its neighbour (0 <-> 1, 2 <-> 3)."""
    swapped = [(i, inputs[i ^ 1]) for i in range(len(inputs))]
    return [iter(list(enumerate(inputs)))] + [iter(swapped) for _ in range(chunks - 1)]


def _interleaved_job(rank: int) -> dict:
    from megatron.core import parallel_state

    report = {}
    for name, overrides in CASES.items():
        chunks = model_chunks(FOUR_LAYERS, **P2P, **overrides)
        shared = forward_backward(chunks, batches(), "shared", SHARE_EVERY_PREFIX)
        packed = forward_backward(chunks, batches(), "packed")
        report[name] = dict(
            shared_vs_packed=compare(shared, packed).max_rel_diff,
            outputs=len(shared.outputs), digests=shared.digests,
            layers=[[layer.layer_number for layer in c.decoder.layers] for c in chunks],
            grads=sorted(shared.grads))
        if name == "even":
            with mock.patch.object(harness, "chunk_iterators", _previous_plans):
                mislaid = forward_backward(chunks, batches(), "shared", SHARE_EVERY_PREFIX)
            report["control"] = compare(mislaid, packed).max_rel_diff
    report["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return report


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_interleaved_job, 4, tp=2, pp=2, vpp=2, timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_shared_step_equals_packed_step_under_interleaved_stages(ranks, case):
    for rank, report in enumerate(ranks):
        worst = {q: d for q, d in report[case]["shared_vs_packed"].items() if d > FP32_RTOL}
        assert not worst, f"rank {rank} {case}: {worst}"


@pytest.mark.parametrize("case, layers", [
    ("even", {0: [[1], [3]], 1: [[2], [4]]}),
    ("uneven_layout", {0: [[1, 2], [4]], 1: [[3], []]}),
    ("uneven_first", {0: [[1], [4]], 1: [[2, 3], [5, 6]]}),
])
def test_each_chunk_holds_its_virtual_stage(ranks, case, layers):
    """What the ranks built, so that the cases above really interleave: pipeline rank 0 holds
    virtual stages 0 and 2, rank 1 stages 1 and 3 (layer numbers from 1)."""
    for report in ranks:
        assert report[case]["layers"] == layers[report["pp_rank"]]


@pytest.mark.parametrize("case", list(CASES))
def test_every_micro_batch_is_scored_on_the_last_stage_with_its_own_plan(ranks, case):
    last = [r for r in ranks if r["pp_rank"] == 1]
    assert all(r[case]["outputs"] == 4 for r in last)
    assert all(r[case]["outputs"] == 0 for r in ranks if r["pp_rank"] == 0)
    digests = {tuple(r[case]["digests"]) for r in ranks}
    assert len(digests) == 1 and len(set(digests.pop())) == 4  # same plans everywhere, 4 kinds


def test_gradients_of_every_chunk_are_compared(ranks):
    """The first chunk's embedding and the last chunk's head are among the compared grads."""
    held = {name for r in ranks for name in r["even"]["grads"]}
    assert {"embedding.word_embeddings.weight", "output_layer.weight",
            "decoder.final_layernorm.weight"} <= held
    assert {f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in range(4)} <= held


def test_control_a_chunk_handed_another_micro_batchs_plan_differs(ranks):
    worst = max(max(r["control"].values()) for r in ranks)
    assert worst > 1e-2, worst
