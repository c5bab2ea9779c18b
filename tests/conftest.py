"""Shared test settings.

- One intra-op thread: the test models are tiny, and on a 2-core machine that also runs
  2-process (TP/PP) tests, OpenMP threads spinning against each other make small ops 20x slower.
  ``OMP_NUM_THREADS=1`` carries that to every process a test spawns (ranks, torchrun, the CLI),
  which would otherwise take every core (``engines.launch.rank_threads``): a one-rank bench
  test took 129 s instead of 57 s (user time 92 s vs 23 s) on this loaded 2-core machine.
- Hypothesis runs derandomized, so CI is reproducible.
"""

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

settings.register_profile(
    "prefix_sharing",
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("prefix_sharing")
