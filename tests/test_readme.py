"""README's commands are what CI runs: the blocks marked for .ci/readme.sh exist, CI runs each
of them in the environment its lines build, and every command they name exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefix_sharing.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = {"setup", "first-run", "trainer"}


def _block(name: str) -> list[str]:
    match = re.search(rf"<!-- ci: {name} -->\n```bash\n(.*?)\n```", README, re.S)
    assert match, f"README has no bash block marked <!-- ci: {name} -->"
    return match.group(1).splitlines()


def test_ci_runs_every_marked_block_in_its_environment():
    run = (ROOT / ".ci" / "run").read_text()
    assert set(re.findall(r"<!-- ci: ([\w-]+) -->", README)) == BLOCKS
    assert 'bash .ci/readme.sh "$venv" setup first-run' in run
    assert "bash .ci/readme.sh .venv-verl091 trainer" in run


def test_the_first_screen_sets_up_then_runs():
    """What it is, then the set-up, then the first command - before anything else."""
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings[:2] == ["Set up", "First run"]
    assert _block("setup")[0].startswith("pip install torch==2.13.0 --index-url ")
    assert "download.pytorch.org/whl/cpu" in _block("setup")[0]


def test_the_blocks_name_commands_that_exist():
    names = {c.__name__.rsplit(".", 1)[-1] for c in COMMANDS}
    lines = [line for block in BLOCKS for line in _block(block)]
    used = {line.split()[1] for line in lines if line.startswith("prefix-sharing ")}
    assert used and used <= names
    for line in lines:  # files a line reads are in the clone
        for path in re.findall(r"\b((?:docs|scripts)/\S+)", line.split("#")[0]):
            assert (ROOT / path).is_file(), path


def test_the_trainer_demo_names_its_environment_when_run_outside_it(tmp_path):
    """In an environment without verl's trainer (this suite's), DEVICE=cpu says in one line
    which environment to build, and exits 2."""
    from prefix_sharing.testing.verl_cpu.compare import missing_modules

    if not missing_modules():
        pytest.skip("verl's trainer is installed here: the demo would run")
    env = dict(os.environ, DEVICE="cpu", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONPATH=str(ROOT))
    result = subprocess.run(["bash", "scripts/run_prefix_sharing.sh", str(tmp_path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and "pip install -e '.[verl]'" in result.stderr
    extra = re.search(r"^verl =\n((?:    .*\n)+)", (ROOT / "setup.cfg").read_text(), re.M)
    assert "verl==0.9.1" in extra.group(1) and "TransferQueue" in extra.group(1)


def test_a_trainer_run_outlasting_its_timeout_is_one_line(monkeypatch, capsys):
    from prefix_sharing.testing.verl_cpu import compare

    def too_slow(*args):
        raise TimeoutError("verl's main_ppo did not finish within 900 s; its log: w/off/main_ppo.log")

    monkeypatch.setattr(compare, "missing_modules", lambda: [])
    monkeypatch.setattr(compare, "main", too_slow)
    assert compare.demo(["w"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "its log: w/off/main_ppo.log" in err, err
