"""The peak-memory estimate refuses, in one line and before any rank starts, a run that would
not fit; a rank killed anyway is one line too."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

from prefix_sharing.cli import main
from prefix_sharing.engines import launch, memory
from prefix_sharing.engines.launch import RankError, run_distributed
from prefix_sharing.errors import RankKilled
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import WORKLOADS, make_workload

GIB = memory.GIB


def _agent_file(path, vocab=151_000, seed=0) -> list[int]:
    """An agent dump like the issue's: 12 rows (3 tasks x 4 branches under one 800-token system
    prompt), ~32k tokens, ids up to ``vocab - 1``; returns the row lengths."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(800)]
    rows = []
    for _ in range(3):
        task = system + [rng.randrange(vocab) for _ in range(800)]
        rows += [task + [rng.randrange(vocab) for _ in range(800 + rng.randrange(400))]
                 for _ in range(4)]
    rows[0][-1] = vocab - 1
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return [len(r) for r in rows]


def test_a_long_large_vocabulary_file_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """12 rows, ~32k tokens, ids up to 151k: the padded plain runs' logits alone are tens of
    GiB. Refused with the estimate, the machine's memory and what fits instead; exit 2, and
    no rank started."""
    lengths = _agent_file(tmp_path / "agent.jsonl")
    assert len(lengths) == 12 and 30_000 < sum(lengths) < 33_000
    monkeypatch.setattr("prefix_sharing.cli.verify.available_bytes", lambda: 20 * GIB)
    monkeypatch.setattr(launch, "_launch", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["verify", "--sequences", str(tmp_path / "agent.jsonl")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("prefix-sharing verify: error: verify would need about "), err
    assert "12 sequences padded to" in err and "151040-token vocabulary" in err
    assert "this machine has 20.0 GiB available: pass fewer rows (its first" in err


def test_the_estimate_bounds_a_measured_run():
    """The run measured for the constants (4 rows of 528-573 tokens, ids up to 151k, the tiny
    preset: 14.5 GiB peak RSS, see docs/cli.md) is estimated above it, and within 1.5x."""
    model = get_preset("tiny").fitted_to(150_999)
    estimate = memory.verify_peak_bytes(model, [534, 554, 528, 573], 4, 8)
    assert 14.5 * GIB < estimate < 1.5 * 14.5 * GIB


def test_the_builtin_runs_are_far_from_any_machine_limit():
    """verify's and demo's workloads on tiny, bench's on small: under 4 GiB (a laptop's free
    memory), so the check does not refuse what the documentation runs."""
    from prefix_sharing.cli.bench import BENCH_SIZES

    tiny, small = get_preset("tiny"), get_preset("small")
    for name in WORKLOADS:
        lengths = [len(s) for s in make_workload(name, vocab_size=tiny.vocab_size).sequences]
        assert memory.verify_peak_bytes(tiny, lengths, 4, 8) < 4 * GIB
    batches = [[len(s) for s in make_workload(n, vocab_size=small.vocab_size,
                                              **BENCH_SIZES[n]).sequences] for n in WORKLOADS]
    assert memory.bench_peak_bytes(small, batches, 4) < 4 * GIB


def test_bench_refuses_a_scale_that_does_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 * GIB)
    assert main(["bench", "--workload", "grpo", "--length-scale", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass a smaller --length-scale" in err, err


def test_the_check_can_be_skipped(monkeypatch):
    monkeypatch.setenv("PREFIX_SHARING_SKIP_MEMORY_CHECK", "1")
    memory.check_fits("verify", 100 * GIB, "x", "y", available=1 * GIB)  # no error
    monkeypatch.delenv("PREFIX_SHARING_SKIP_MEMORY_CHECK")
    with pytest.raises(memory.InputError, match="about 100.0 GiB"):
        memory.check_fits("verify", 100 * GIB, "x", "y", available=1 * GIB)


def _killed(rank: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does


def _exits(rank: int) -> None:
    os._exit(3)


def test_a_killed_rank_is_one_line_naming_memory(monkeypatch, capsys):
    with pytest.raises(RankKilled, match="^rank 0 was killed by SIGKILL - on Linux most often "
                                         "the out-of-memory killer"):
        run_distributed(_killed, 1)

    def verify_killed(self, request, tp=1, pp=1, cp=1):
        return run_distributed(_killed, 1)

    monkeypatch.setattr("prefix_sharing.engines.Engine.verify", verify_killed)
    assert main(["verify"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("prefix-sharing verify: error: rank 0 was "
                                                   "killed by SIGKILL"), err


def test_a_rank_that_exits_without_a_result_is_still_a_bug():
    with pytest.raises(RankError, match="rank 0 exited with code 3 without a result"):
        run_distributed(_exits, 1)
