"""verl's real FSDP engine accepts Gemma 3 (sliding-window layers) with sharing on, and gives
what it gives with sharing off: log-probs, entropy, verl's ``ppo_loss`` and every gradient, fp32
within 1e-5 (GRPO and tree batches, one rank). The tiny checkpoint carries a 4-token window,
shorter than the batches' prompts, so reusers' gathers are trimmed.

gpt-oss is not compared here: verl's plain path packs a micro-batch into one row told apart by
restarting ``position_ids``, and transformers' gpt-oss (5.10 and 5.24) builds its masks without
``position_ids``, so on any kernel but flash-attention its plain packed forward lets the second
sequence read the first (checked: 0.35 max logit difference against each sequence alone). Its
sharing path is checked against transformers' own per-sequence forward instead
(``tests/fsdp_compat/test_windowed_families.py``).
"""

import dataclasses
import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import PRESET, run, save_model  # noqa: E402

SHARING = {"off": None, "arbitrary_prefix": MODES["arbitrary_prefix"]}
WINDOWED = dataclasses.replace(PRESET, window_size=4)


@pytest.fixture(scope="module", params=["gemma3_text"])
def runs(request, tmp_path_factory):
    path = save_model(str(tmp_path_factory.mktemp(request.param)), request.param,
                      preset=WINDOWED)
    return request.param, run_gloo(run, 1, path, ["grpo", "tree"], SHARING, timeout=600)[0]


def test_windowed_families_match_the_feature_off(runs):
    family, results = runs
    for workload in ("grpo", "tree"):
        on = results[workload, "arbitrary_prefix"]
        assert on["attention_calls"] > 0, f"{family}: the sharing attention never ran"
        same_outputs(on, results[workload, "off"], f"{family} {workload}")
