"""Device-to-host reads per shared forward+backward do not grow with layers or segments.

On a GPU every such read (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero`` ...) stalls the
host until the device catches up; one per micro-batch is noise, one per layer or per segment
is not. CPU tensors never stall, so the reads are counted instead
(``tests/attention/host_reads.py``: Python-level value reads, and operators that read values
back, forward and backward).

Counted over ``model(...)`` and ``backward()`` of a planned micro-batch (GRPO: each prompt's
first answer computes the prompt, the others reuse it), for 4 and 8 layers and for 2 and 4
prompts (6 and 12 attention segments).
"""

from __future__ import annotations

import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.workloads import make_workload
from tests.attention.host_reads import count_host_reads

from ._distributed import PRESET, run_distributed, tiny_gpt

SHARE_PROMPTS = PrefixSharingConfig(min_prefix_len=1, backend="torch")


def _shared_step(num_layers: int, num_prompts: int) -> dict[str, int]:
    from prefix_sharing.megatron_ext import prepare_micro_batch

    model = tiny_gpt(num_layers=num_layers)
    sequences = make_workload("grpo", vocab_size=PRESET.vocab_size, seed=0,
                              num_prompts=num_prompts, group_size=3).sequences
    mb = prepare_micro_batch(sequences, SHARE_PROMPTS, device="cpu")
    assert mb.plan.has_sharing and mb.plan.cu_seqlens_q.numel() - 1 == 3 * num_prompts

    def step() -> None:
        logits = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)
        logits.float().square().mean().backward()

    return count_host_reads(step)


def _counts_job(rank: int) -> dict:
    return {(layers, prompts): _shared_step(layers, prompts)
            for layers, prompts in ((4, 2), (8, 2), (4, 4))}


def test_host_reads_do_not_grow_with_layers_or_segments():
    counts = run_distributed(_counts_job, 1, timeout=300)[0]
    print("host reads per forward+backward (layers, prompts):", counts)
    base = counts[(4, 2)]
    assert counts[(8, 2)] == base, f"doubling the layers: {base} -> {counts[(8, 2)]}"
    assert counts[(4, 4)] == base, f"doubling the segments: {base} -> {counts[(4, 4)]}"
