"""Device-to-host reads per shared forward+backward do not grow with layers or segments.

On a GPU every such read (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero`` ...) stalls the
host until the device catches up; one per micro-batch is noise, one per layer or per segment
is not. CPU tensors never stall, so the reads are counted instead
(``tests/attention/host_reads.py``: Python-level value reads, and operators that read values
back, forward and backward).

Counted over ``model(...)`` and ``backward()`` of a planned micro-batch (GRPO: each prompt's
first answer computes the prompt, the others reuse it), for 4 and 8 layers and for 2 and 4
prompts (6 and 12 attention segments); and, for comparison, of megatron's stock THD batch of
the same sequences; and of the planned micro-batch split over two context-parallel ranks.
``pytest -s`` prints the counts.
"""

from __future__ import annotations

import pytest

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.workloads import make_workload
from tests.attention.host_reads import count_host_reads

from ._distributed import PRESET, run_distributed, tiny_gpt

SHARE_PROMPTS = PrefixSharingConfig(min_prefix_len=1, backend="torch")


def _step(layout: str, num_layers: int, num_prompts: int,
          backend: str | None = None) -> dict[str, int]:
    """Host reads of one forward+backward: ``"shared"`` a planned micro-batch, ``"stock"``
    megatron's plain THD batch of the same sequences (megatron's own RoPE, no plan), its core
    attention on ``backend`` where one is named."""
    from prefix_sharing.megatron_ext import prepare_micro_batch
    from prefix_sharing.megatron_ext.packed_seq import plain_micro_batch

    model = tiny_gpt(num_layers=num_layers)
    sequences = make_workload("grpo", vocab_size=PRESET.vocab_size, seed=0,
                              num_prompts=num_prompts, group_size=3).sequences
    if layout == "shared":
        mb = prepare_micro_batch(sequences, SHARE_PROMPTS, device="cpu")
        assert mb.plan.has_sharing and mb.plan.cu_seqlens_q.numel() - 1 == 3 * num_prompts
    else:
        mb = plain_micro_batch(sequences, device="cpu")
        if backend is not None:
            mb.packed_seq_params.backend = backend

    def step() -> None:
        logits = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        logits.float().square().mean().backward()

    return count_host_reads(step)


SIZES = ((4, 2), (8, 2), (4, 4))  # (layers, prompts): base, layers doubled, segments doubled


def _counts_job(rank: int) -> dict:
    return {layout: {size: _step(layout, *size) for size in SIZES}
            for layout in ("shared", "stock")}


@pytest.fixture(scope="module")
def counts() -> dict:
    counts = run_distributed(_counts_job, 1, timeout=300)[0]
    print("host reads per forward+backward, by (layers, prompts):", counts)
    return counts


def test_shared_step_reads_do_not_grow_with_layers_or_segments(counts):
    shared = counts["shared"]
    base = shared[(4, 2)]
    assert shared[(8, 2)] == base, f"doubling the layers: {base} -> {shared[(8, 2)]}"
    assert shared[(4, 4)] == base, f"doubling the segments: {base} -> {shared[(4, 4)]}"


def _cp_counts_job(rank: int) -> dict:
    return {size: _step("shared", *size) for size in SIZES}


def test_context_parallel_step_reads_do_not_grow_with_layers_or_segments(counts):
    """At CP=2 each rank's slice, the K/V all-gathers and their reduce-scatters add no read:
    the slices' boundaries are host ints built with the plan."""
    for rank, cp in enumerate(run_distributed(_cp_counts_job, 2, cp=2, timeout=300)):
        print(f"CP=2 rank {rank}:", cp)
        assert cp[(8, 2)] == cp[(4, 2)] == cp[(4, 4)] == counts["shared"][(4, 2)], cp


def _flex_counts_job(rank: int) -> dict:
    from prefix_sharing.attention import flex_backend
    from tests.attention import fake_kernels

    # FlexAttention's documented semantics in the CPU op's place (no CPU backward in torch)
    pytest.MonkeyPatch().setattr(flex_backend, "_flex_attention",
                                 lambda device: fake_kernels.flex_attention)
    return {size: _step("stock", *size, backend="flex") for size in SIZES}


def test_flex_on_the_plain_thd_step_reads_the_boundaries_once(counts):
    """FlexAttention builds its mask from host boundaries (READS_HOST_BOUNDARIES): on
    megatron's plain THD batch the core attention reads them once per micro-batch, not in
    every layer - the same reads as the torch kernel there, at every size (megatron's own
    RoPE reads in every layer either way)."""
    flex = run_distributed(_flex_counts_job, 1, timeout=300)[0]
    print("host reads, plain THD step on flex:", flex)
    assert flex == counts["stock"], flex


def test_stock_thd_step_reads_do_not_grow_with_segments(counts):
    """The plain baseline: megatron's own THD RoPE reads the boundaries in every layer (its
    code, what users run today), but the core attention adds nothing per segment."""
    stock = counts["stock"]
    assert stock[(4, 4)] == stock[(4, 2)]
    assert all(stock[s]["value_reads"] >= counts["shared"][s]["value_reads"] for s in SIZES)
