"""The CPU test rollout (``prefix_sharing.testing.verl_cpu``) refuses weights it cannot load,
naming the wire format, before it touches the server."""

import asyncio

import pytest

from prefix_sharing.errors import UnsupportedSetup

from ._requires import require_verl

require_verl(("0.9.1", "0.8.0"))
pytest.importorskip("ray")


def test_a_wire_format_other_than_full_tensors_is_refused_naming_it():
    from prefix_sharing.testing.verl_cpu.rollout import adapter_class

    adapter_type = adapter_class()
    adapter = adapter_type.__new__(adapter_type)  # the check runs before any of its state
    with pytest.raises(UnsupportedSetup, match="wire_format='delta_flush'"):
        asyncio.run(adapter.update_weights(iter(()), wire_format="delta_flush"))
