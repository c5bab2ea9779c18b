"""The host-read counters used by the sync tests see every kind of read they claim to."""

import torch

from tests.attention.host_reads import count_host_reads


def test_the_counters_see_host_reads():
    def reads() -> None:
        t = torch.tensor([1, 0, 2])
        t.tolist(), t[0].item(), bool(t[0]), int(t[1]), t.nonzero(), t.repeat_interleave(t)
        t.repeat_interleave(t, output_size=3)  # shape known: no read

    # 4 Python reads, each lowering to _local_scalar_dense except tolist; + nonzero, repeat
    assert count_host_reads(reads) == {"value_reads": 4, "syncing_ops": 5}


def test_nothing_counted_without_reads():
    t = torch.arange(6.0, requires_grad=True)
    counts = count_host_reads(lambda: (t * 2).sum().backward())
    assert counts == {"value_reads": 0, "syncing_ops": 0}
