"""``python -m prefix_sharing.npu.run_megatron_lm SCRIPT ARGS``: MindSpeed's feature is in
place before the unmodified Megatron-LM script runs as ``__main__`` with its own arguments."""

from __future__ import annotations

import json
import sys

import pytest

from prefix_sharing.npu import run_megatron_lm


def test_script_runs_as_main_with_its_arguments_after_mindspeed(monkeypatch, tmp_path):
    events = []
    monkeypatch.setattr(run_megatron_lm, "enable_mindspeed", lambda: events.append("enabled"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    record = tmp_path / "seen.json"
    script = tmp_path / "pretrain_gpt.py"
    script.write_text(
        "import json, sys\n"
        f"json.dump({{'name': __name__, 'argv': sys.argv}}, open({str(record)!r}, 'w'))\n"
    )
    run_path = run_megatron_lm.runpy.run_path
    monkeypatch.setattr(run_megatron_lm.runpy, "run_path", _after(events, run_path))
    run_megatron_lm.main([str(script), "--num-layers", "2"])
    assert events == ["enabled", "ran"]
    assert json.loads(record.read_text()) == {
        "name": "__main__", "argv": [str(script), "--num-layers", "2"]}


def test_module_runs_as_main_with_its_arguments_after_mindspeed(monkeypatch, tmp_path):
    events = []
    monkeypatch.setattr(run_megatron_lm, "enable_mindspeed", lambda: events.append("enabled"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.syspath_prepend(str(tmp_path))
    record = tmp_path / "seen.json"
    (tmp_path / "entry_module_recorder.py").write_text(
        "import json, sys\n"
        f"json.dump({{'name': __name__, 'argv': sys.argv[1:]}}, open({str(record)!r}, 'w'))\n"
    )
    run_module = run_megatron_lm.runpy.run_module
    monkeypatch.setattr(run_megatron_lm.runpy, "run_module", _after(events, run_module))
    run_megatron_lm.main(["-m", "entry_module_recorder", "sft", "--num-layers", "2"])
    assert events == ["enabled", "ran"]
    assert json.loads(record.read_text()) == {
        "name": "__main__", "argv": ["sft", "--num-layers", "2"]}


def _after(events, run_path):
    def record_then_run(*args, **kwargs):
        events.append("ran")
        return run_path(*args, **kwargs)
    return record_then_run


@pytest.mark.parametrize("argv", [[], ["--num-layers", "2"], ["-m"]])
def test_without_a_script_it_prints_the_usage(argv):
    with pytest.raises(SystemExit, match="usage: python -m prefix_sharing.npu.run_megatron_lm"):
        run_megatron_lm.main(argv)
