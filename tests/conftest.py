"""Shared test settings.

- One intra-op thread: the test models are tiny, and on a 2-core machine that also runs
  2-process (TP/PP) tests, OpenMP threads spinning against each other make small ops 20x slower.
- Hypothesis runs derandomized, so CI is reproducible.
"""

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

settings.register_profile(
    "prefix_sharing",
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("prefix_sharing")
