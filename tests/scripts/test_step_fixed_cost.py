"""scripts/step_fixed_cost.py: the split of a step's time into a fixed part and the part that
scales with the computed tokens."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "step_fixed_cost.py"


def load_script():
    spec = importlib.util.spec_from_file_location("step_fixed_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_part_above_the_fixed_cost_gets_the_whole_saving():
    """plain = 30 + 90, shared = 30 + 30: 2x overall, 3x (the FLOP ratio) above the 30 ms that
    both steps spend whatever the tokens; the fixed part is half the shared step."""
    parts = load_script().decompose(
        {"tree/plain": 120.0, "tree/shared": 60.0, "floor/plain": 30.0, "floor/shared": 30.0},
        flop_ratio=3.0)
    assert parts == pytest.approx({"speedup": 2.0, "of_flop": 2 / 3,
                                   "fixed_share_of_shared_step": 0.5,
                                   "speedup_above_fixed": 3.0, "above_fixed_of_flop": 1.0})
