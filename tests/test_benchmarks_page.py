"""The benchmarks page and README's figure blocks are generated from docs/results, and stay so.

``scripts/docs/benchmarks_page.py`` renders docs/benchmarks.md and the README blocks from the
result files; these tests fail when either is stale, when a result lacks its provenance or has
a malformed table, and they run the generator on a temporary copy of the tree to show that its
check catches a modified result and that a result the page does not name is still rendered.
``prefix-sharing bench --record`` is run once (tiny preset, one repeat): its fields are checked,
never its timings.
"""

import importlib.util
import json
import os
import shutil
import sys
from datetime import datetime, timedelta, timezone
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from prefix_sharing.cli import main
from prefix_sharing.cli.bench import table

ROOT = Path(__file__).resolve().parents[1]


def _load_generator():
    name = "benchmarks_page"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "scripts" / "docs" / "benchmarks_page.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


page = _load_generator()


@pytest.fixture
def tree(tmp_path):
    """A copy of what the generator reads and writes: docs/results, the pages, README."""
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    for page_path in (ROOT / "docs").glob("*.md"):
        shutil.copy(page_path, tmp_path / "docs" / page_path.name)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def _edit(path: Path, change) -> None:
    result = json.loads(path.read_text())
    change(result)
    path.write_text(json.dumps(result, indent=1) + "\n")


def test_the_page_and_every_block_are_the_generated_text():
    assert page.stale(ROOT) == [], "run: python scripts/docs/benchmarks_page.py"
    readme = (ROOT / "README.md").read_text()
    assert readme.count(": begin -->") == readme.count(": end -->") == 2
    generated = set(page.render_all(ROOT))
    assert {ROOT / "docs/verl.md", ROOT / "docs/megatron-lm.md"} <= generated
    assert (ROOT / "docs" / "benchmarks.md").read_text().startswith(page.GENERATED)


def test_every_result_has_its_provenance_and_valid_figures():
    results = page.load_results(ROOT)  # validates each file
    assert len(results) >= 30
    for name, result in results.items():
        for key in ("command", "date", "machine", "versions"):
            assert result[key], f"{name}: {key}"
        assert any(key in result for key in page.FIGURES), name
        if "table" in result:
            columns = result["table"]["columns"]
            assert result["table"]["rows"], name
            assert all(len(row) == len(columns) for row in result["table"]["rows"]), name


def test_every_result_is_sourced_on_the_page():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for name in page.load_results(ROOT):
        assert f"Source: [`{name}.json`](results/{name}.json)" in text, name
    assert "## Other results" not in text  # every result has its place in a section


def test_a_recorded_bench_output_is_the_table_of_its_payload():
    results = page.load_results(ROOT)
    step_runs = [name for name, r in results.items()
                 if "output" in r and "payload" in r
                 and "speedup" in (r["payload"].get("results") or [{}])[0]]  # analyze: no results
    assert "training_step_small" in step_runs
    for name in step_runs:
        assert results[name]["output"] == table(results[name]["payload"]["results"]), name


def test_the_check_passes_on_a_faithful_copy_and_fails_on_a_modified_result(tree):
    assert page.stale(tree) == []  # the control: the copy renders as the checked-in text
    _edit(tree / "docs/results/training_step_small.json",
          lambda r: r["payload"]["results"][0].update(speedup=9.99))
    assert page.stale(tree) == [tree / "README.md"]  # README's table reads the payload
    _edit(tree / "docs/results/planner.json", lambda r: r["table"]["rows"][0].__setitem__(3, "1.0"))
    assert page.stale(tree) == [tree / "docs/benchmarks.md", tree / "README.md"]
    rendered = page.render_all(tree)
    assert "| 9.99x |" in rendered[tree / "README.md"]
    assert "| 1.0 |" in rendered[tree / "docs/benchmarks.md"]


def test_a_figure_quoted_on_another_page_follows_its_result(tree):
    _edit(tree / "docs/results/dp_balancing.json", lambda r: r["values"].update(grpo_stock="1.5"))
    assert page.stale(tree) == [tree / "docs/benchmarks.md", tree / "docs/verl.md"]
    assert "against\n1.5 under verl's stock balancing" in page.render_all(tree)[tree / "docs/verl.md"]


def test_a_result_the_page_does_not_name_is_rendered_under_other_results(tree):
    shutil.copy(tree / "docs/results/planner.json", tree / "docs/results/planner_again.json")
    _edit(tree / "docs/results/planner_again.json", lambda r: r.update(title="Planner again"))
    assert page.stale(tree) == [tree / "docs/benchmarks.md"]
    text = page.render_all(tree)[tree / "docs/benchmarks.md"]
    others = text[text.index("## Other results"):]
    assert "### Planner again" in others
    assert "Source: [`planner_again.json`](results/planner_again.json)" in others
    assert "| grpo (16 prompts x 8) | 524288 |" in others


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("date"), "missing date"),
    (lambda r: r.update(machine=""), "missing machine"),
    (lambda r: r["table"]["rows"][1].pop(), "every table row"),
    (lambda r: r.update(versions={"torch": ""}), "versions must map"),
    (lambda r: r.pop("table"), "holds none of"),
    (lambda r: r["table"].pop("align"), "a table holds columns, align and rows"),
])
def test_a_result_without_provenance_or_with_a_broken_table_is_refused(tree, change, message):
    _edit(tree / "docs/results/planner.json", change)
    with pytest.raises(page.ResultError, match=message):
        page.render_all(tree)


@pytest.mark.parametrize("line, message", [
    ("{{ table no_such_result }}", "no result file docs/results/no_such_result.json"),
    ("{{ planner.no_such_value }}", "has no value 'no_such_value'"),
    ("{{ planner[forest].tokens }}", "0 rows start with 'forest'"),
    ("{{ chart planner }}", "unknown directive"),
    ("a sentence quoting {{ planner }} inline", "is no directive, value or cell"),
])
def test_a_template_naming_what_does_not_exist_fails(tree, line, message):
    template = tree / "docs/results/benchmarks.md.in"
    template.write_text(template.read_text() + "\n" + line + "\n")
    with pytest.raises(page.ResultError, match=message):
        page.render_all(tree)


def test_bench_record_writes_a_result_file_with_its_provenance(tree, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tree / "docs/results/tiny_grpo.json"
    argv = ["bench", "--model", "tiny", "--repeats", "1", "--workload", "grpo"]
    assert main([*argv, "--record", str(path)]) == 0
    printed = capfd.readouterr().out
    result = json.loads(path.read_text())
    page.check_result("tiny_grpo", result)
    assert result["command"] == "OMP_NUM_THREADS=1 prefix-sharing " + " ".join(argv)
    recorded = datetime.strptime(result["date"], "%Y-%m-%d %H:%M UTC").replace(
        tzinfo=timezone.utc)
    assert timedelta(0) <= datetime.now(timezone.utc) - recorded < timedelta(hours=1)
    machine = result["machine"]
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    assert machine["cpus"] == os.cpu_count() and machine["accelerator"] == accelerator
    assert set(machine) == {"platform", "cpus", "torch threads", "load average (1 min)",
                            "accelerator"}
    assert result["versions"]["torch"] == version("torch")
    assert result["versions"]["prefix-sharing"] == version("prefix-sharing")
    if importlib.util.find_spec("megatron") is not None:
        assert result["versions"]["megatron-core"] == version("megatron-core")
    payload = result["payload"]
    assert payload["model"] == "tiny" and [r["workload"] for r in payload["results"]] == ["grpo"]
    assert result["output"] == table(payload["results"]) == printed.rstrip("\n")
    # the new measurement reaches the page with no template edit, under "Other results"
    text = page.render_all(tree)[tree / "docs/benchmarks.md"]
    assert "### Training step, megatron engine, tiny preset" in text
    assert f"`{result['command']}`; {result['date']};" in text
