"""``bench`` refuses what it cannot time on this machine before building anything."""

from __future__ import annotations

import pytest
import torch

from prefix_sharing.engines.bench import check_plain_step_runs
from prefix_sharing.errors import UnsupportedSetup
from prefix_sharing.presets import PRESETS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_a_gated_deltanet_hybrid_is_refused_without_a_gpu_naming_verify():
    with pytest.raises(UnsupportedSetup, match=r"bench --model tiny-hybrid: .*flash-linear-"
                                               r"attention's CUDA kernels.*verify --model "
                                               r"tiny-hybrid"):
        check_plain_step_runs(PRESETS["tiny-hybrid"])
