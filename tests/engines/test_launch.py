"""How many intra-op threads a spawned rank takes."""

from __future__ import annotations

import pytest

from prefix_sharing.engines import launch


@pytest.mark.parametrize("asked, world, expected", [
    (None, 1, 8), (None, 2, 4), (None, 16, 1),  # the cores shared between the ranks
    ("1", 1, 1), ("3", 2, 3), ("16", 2, 4),  # OMP_NUM_THREADS caps the share
    ("", 2, 4), ("0", 2, 4), ("x", 2, 4),  # unset in effect: the share
])
def test_a_rank_takes_its_share_of_the_cores_at_most_omp_num_threads(monkeypatch, asked, world,
                                                                     expected):
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 8)
    if asked is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", asked)
    assert launch.rank_threads(world) == expected
