"""scripts/profile_step.py: the speedup against the FLOP ratio, with and without the fixed cost
of a step."""

import pytest

from tests.script_modules import load_script


def test_the_part_above_the_fixed_cost_gets_the_whole_saving():
    """plain = 30 + 90, shared = 30 + 30: 2x overall (2/3 of a FLOP ratio of 3), 3x - the FLOP
    ratio - above the 30 ms both steps spend whatever their tokens."""
    of_flop_ratio = load_script("profile_step").of_flop_ratio
    assert of_flop_ratio(120.0, 60.0, 30.0, flop_ratio=3.0) == pytest.approx((2 / 3, 1.0))
