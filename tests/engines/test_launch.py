"""How many intra-op threads a rank takes; a launch whose port was taken is retried; ranks fork
from a server that imported torch and megatron-core, and see what a spawned rank would: the
caller's stdout / stderr and environment now (spawned under a prefix-sharing switch)."""

from __future__ import annotations

import os
import socket
import sys

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


def _rank_and_world(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


def test_a_launch_whose_port_was_taken_meanwhile_runs_on_another(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], launch.free_port()])
        asked = []
        monkeypatch.setattr(launch, "free_port", lambda: asked.append(1) or next(ports))
        assert launch.run_distributed(_rank_and_world, 1, 1) == [(0, 1)]
    assert len(asked) == 2


def test_a_rank_error_that_is_not_the_port_is_not_retried(monkeypatch):
    asked, free_port = [], launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: asked.append(1) or free_port())
    with pytest.raises(launch.RankError, match="rank 0 failed"):
        launch.run_distributed(_rank_and_world, 1)  # world_size missing: a TypeError
    assert len(asked) == 1



def _parent_and_variables(rank: int) -> tuple[int, str | None, str | None]:
    print(f"rank {rank} says hello", file=sys.stderr, flush=True)
    return (os.getppid(), os.environ.get("LAUNCH_PROBE"),
            os.environ.get("PREFIX_SHARING_LAUNCH_PROBE"))


def test_ranks_fork_from_a_server_and_see_the_callers_environment_and_stderr_now(
        capfd, monkeypatch):
    launch.run_distributed(_rank_and_world, 1, 1)  # the server may start here, under other fds
    monkeypatch.setenv("LAUNCH_PROBE", "set")
    capfd.readouterr()
    (parent, variable, switch), = launch.run_distributed(_parent_and_variables, 1)
    assert parent != os.getpid()  # the fork server's child, not this process's
    assert variable == "set" and switch is None
    assert "rank 0 says hello" in capfd.readouterr().err


def test_a_launch_under_a_prefix_sharing_switch_spawns_its_ranks(monkeypatch):
    """Importing prefix_sharing reads its switches, before a forked rank could set them."""
    monkeypatch.setenv("PREFIX_SHARING_LAUNCH_PROBE", "set")
    (parent, _, switch), = launch.run_distributed(_parent_and_variables, 1)
    assert switch == "set" and parent == os.getpid()  # spawned by this process
