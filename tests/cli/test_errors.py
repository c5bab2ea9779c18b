"""Errors that help and never hide: one line for bad input, the traceback for a bug.

Bad input (an :class:`~prefix_sharing.errors.InputError`, also when a spawned rank finds it) is
one line on stderr and exit status 2; anything else is a bug and keeps its traceback - a failed
rank's included - and ``--debug`` shows the traceback of bad input too.
"""

from __future__ import annotations

import pytest

from prefix_sharing import engines
from prefix_sharing.cli import main
from prefix_sharing.engines.launch import RankError, RemoteTraceback, run_distributed
from prefix_sharing.errors import InputError, MissingPackageError, UnsupportedSetup


def _bad_input_in_rank(rank: int) -> None:
    raise InputError(f"sequence {rank} is\nnot usable")


def _bug_in_rank(rank: int) -> None:
    raise ValueError("an internal invariant broke")


def test_input_errors_stay_value_errors():
    """Callers that catch ValueError (config, planner, rollouts) keep working."""
    assert issubclass(InputError, ValueError)
    assert issubclass(MissingPackageError, InputError)
    assert issubclass(MissingPackageError, ImportError)


def test_a_refused_setup_is_bad_input_and_stays_a_runtime_error():
    """Megatron's refusals are the user's to fix; callers catching RuntimeError keep working."""
    from prefix_sharing.megatron_ext import UnsupportedSetupError

    assert issubclass(UnsupportedSetup, InputError)
    assert issubclass(UnsupportedSetupError, UnsupportedSetup)
    assert issubclass(UnsupportedSetupError, RuntimeError)


def test_bad_input_found_in_a_rank_names_the_rank_and_carries_its_traceback():
    with pytest.raises(InputError, match="^rank 0: sequence 0 is\nnot usable$") as caught:
        run_distributed(_bad_input_in_rank, 1)
    cause = caught.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "_bad_input_in_rank" in str(cause)


def test_a_bug_in_a_rank_brings_the_rank_traceback():
    with pytest.raises(RankError, match=r"(?s)rank 0 failed:\nTraceback.*_bug_in_rank.*"
                                        r"ValueError: an internal invariant broke"):
        run_distributed(_bug_in_rank, 1)


@pytest.fixture
def verify_raises(monkeypatch):
    """``verify`` whose engine run raises the given exception (no model is built)."""
    def install(error: Exception) -> None:
        def fail(self, request, tp=1, pp=1, cp=1):
            raise error

        monkeypatch.setattr(engines.Engine, "verify", fail)

    return install


def test_the_command_prints_bad_input_as_one_line(capsys, verify_raises):
    verify_raises(InputError("rank 1: sequence 3 is\nnot usable"))
    assert main(["verify"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "prefix-sharing verify: error: rank 1: sequence 3 is not usable\n"


def test_the_command_keeps_the_traceback_of_a_bug(verify_raises):
    verify_raises(ValueError("an internal invariant broke"))  # a ValueError, but not input
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["verify"])
    verify_raises(RankError("rank 0 failed:\nTraceback ..."))
    with pytest.raises(RankError):
        main(["verify"])


def test_debug_shows_the_traceback_of_bad_input_too():
    with pytest.raises(InputError, match="--steps must be at least 1"):
        main(["--debug", "verify", "--steps", "0"])


def test_a_missing_package_is_bad_input(capsys, monkeypatch):
    def not_installed(self):
        raise MissingPackageError("the megatron engine needs megatron.core (pip install ...)")

    monkeypatch.setattr(engines.Engine, "check_installed", not_installed)
    assert main(["verify"]) == 2
    assert "needs megatron.core" in capsys.readouterr().err


def _shared_step_with_capacity_factor(rank: int, request) -> None:
    """The shared step of ``request``'s model, with a capacity factor (token dropping)."""
    from prefix_sharing.engines.megatron import forward_backward, gpt_model

    model = gpt_model(request.preset, moe_expert_capacity_factor=1.0)
    forward_backward(model, [request.batches[0][0]], "shared", request.config)


def test_the_command_prints_a_setup_refused_in_a_rank_as_one_line(capsys, monkeypatch):
    """``verify --model tiny-moe`` with token dropping: megatron_ext refuses it in the rank."""
    def verify_with_capacity_factor(self, request, tp=1, pp=1, cp=1):
        return run_distributed(_shared_step_with_capacity_factor, 1, request, timeout=300)

    monkeypatch.setattr(engines.Engine, "verify", verify_with_capacity_factor)
    assert main(["verify", "--model", "tiny-moe"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("prefix-sharing verify: error: rank 0: prefix sharing refuses MoE token "
                          "dropping by capacity (moe_expert_capacity_factor=1.0): which tokens "
                          "an expert drops"), err
