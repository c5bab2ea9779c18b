"""scripts/gpu_check.py runs end to end on CPU: the torch backend on the tiny preset; and its
probe tells what each kernel can run before anything runs on it.

The script's real job (flash-attn and TE kernels, timing) needs a CUDA machine; the smoke test
runs the same code path here, in a subprocess with the GPUs hidden, as CI would. The probe is
tested with faked kernel packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    json_path, markdown_path = out / "check.json", out / "check.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--repeats", "1",
         "--json", str(json_path), "--markdown", str(markdown_path)],
        cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=300,
    )
    report = json.loads(json_path.read_text()) if json_path.exists() else None
    markdown = markdown_path.read_text() if markdown_path.exists() else None
    return proc, report, markdown


def test_exits_zero_and_writes_both_reports(run):
    proc, report, markdown = run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] is True
    assert "## Equivalence" in markdown and "## Timing" in markdown


def test_cuda_backends_are_reported_as_skipped_rows_never_as_passed(run):
    _, report, _ = run
    for name in ("flash_attn", "te", "te/te-spec"):
        rows = [r for r in report["equivalence"] + report["timing"] if r["backend"] == name]
        assert [(r["result"], r["status"]) for r in rows] == [("skipped", "not installed")]
    assert "flash_attn: not installed" in run[0].stdout
    assert "skipped: flash_attn (not installed)" in report["summary"]
    # FlexAttention is in torch, but has no CPU backward
    flex = [r for r in report["equivalence"] + report["timing"] if r["backend"] == "flex"]
    assert [(r["result"], r["status"]) for r in flex] == [("skipped", "needs CUDA")]


def test_torch_checks_pass_in_both_dtypes_on_every_workload(run):
    _, report, _ = run
    checks = [r for r in report["equivalence"] if r["backend"] == "torch"]
    assert {(r["dtype"], r["workload"]) for r in checks} == {
        (dtype, workload) for dtype in ("float32", "bfloat16")
        for workload in ("grpo", "steprl", "tree", "agent", "none")
    }
    assert all(r["result"] == "ok" for r in checks), [r for r in checks if r["result"] != "ok"]
    # the plain bf16 reference rows carry megatron's own bf16 error, which the rule scales
    assert all(r["max_rel_diff"]["logits"] > 0 for r in report["equivalence"]
               if r["backend"] == "stock")


def test_timing_rows_have_positive_times(run):
    _, report, _ = run
    rows = report["timing"]
    assert {r["workload"] for r in rows} == {"grpo", "tree", "agent", "none"}
    for row in rows:
        assert row["result"] == "ok", row
        assert row["plain_ms"] > 0 and row["shared_ms"] > 0 and row["planner_ms"] > 0
        assert row["flop_ratio"] >= 1 and row["speedup"] > 0
        assert len(row["plain_steps_ms"]) == len(row["shared_steps_ms"]) == 1
    by_name = {r["workload"]: r for r in rows}
    assert by_name["tree"]["tokens_unique"] < by_name["tree"]["tokens_total"]
    assert by_name["none"]["tokens_unique"] == by_name["none"]["tokens_total"]


# ----------------------------------------------------------------------------- the probe
def _fake_imports(broken: dict[str, Exception]):
    """``import_module`` for a machine with flash-attn 2.7.4 and transformer-engine 2.5 whose
    modules in ``broken`` raise."""
    versions = {"flash_attn": "2.7.4", "transformer_engine": "2.5.0"}

    def import_module(name):
        if name in broken:
            raise broken[name]
        if name.split(".")[0] not in versions:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return types.SimpleNamespace(__version__=versions[name.split(".")[0]])

    return import_module


CUDA = torch.device("cuda")  # only its type is read: no kernel runs with a fake smoke test


def test_te_whose_pytorch_extension_does_not_load_is_not_available():
    """``import transformer_engine`` succeeds without its PyTorch extension; the probe
    imports ``transformer_engine.pytorch``, the module the kernel comes from."""
    gpu_check = load_script("gpu_check")
    broken = {"transformer_engine.pytorch": OSError("libcudnn_graph.so.9: cannot open shared "
                                                    "object file\nmore detail")}
    found = gpu_check.probe_backends(CUDA, smoke=lambda name, device: None,
                                     import_module=_fake_imports(broken))
    assert found["te"] == {"status": "import failed: transformer_engine.pytorch: OSError: "
                                     "libcudnn_graph.so.9: cannot open shared object file",
                           "version": "2.5.0"}
    assert found["flash_attn"] == {"status": "available", "version": "2.7.4"}


def test_a_kernel_that_cannot_run_the_prefix_layout_is_skipped_with_the_reason():
    gpu_check = load_script("gpu_check")
    reasons = {"te": "RuntimeError: no fused attention kernel for THD + GQA + bottom-right"}
    found = gpu_check.probe_backends(CUDA, smoke=lambda name, device: reasons.get(name),
                                     import_module=_fake_imports({}))
    assert found["te"]["status"] == f"cannot run: {reasons['te']}"
    assert found["flash_attn"]["status"] == "available"
    rows = gpu_check.skipped_rows(found)
    assert [(r["backend"], r["result"], r["status"]) for r in rows] == [
        ("te", "skipped", found["te"]["status"]),
        ("te/te-spec", "skipped", found["te"]["status"]),  # the TE layer spec runs TE kernels
    ]
    ok, text = gpu_check.summary(rows, [], found)
    assert ok and "skipped: te (cannot run: RuntimeError" in text


def test_missing_and_broken_packages_are_told_apart():
    gpu_check = load_script("gpu_check")
    broken = {"flash_attn": ImportError("undefined symbol: _ZN3c10"),
              "transformer_engine": ModuleNotFoundError("No module named 'transformer_engine'",
                                                        name="transformer_engine")}
    found = gpu_check.probe_backends(CUDA, smoke=lambda name, device: None,
                                     import_module=_fake_imports(broken))
    assert found["flash_attn"] == {"status": "import failed: ImportError: undefined symbol: "
                                             "_ZN3c10", "version": None}
    assert found["te"] == {"status": "not installed", "version": None}
    assert found["torch"]["status"] == "available"


def test_kernels_need_cuda_before_any_smoke_test():
    gpu_check = load_script("gpu_check")

    def smoke(name, device):
        raise AssertionError("no kernel may run on a CPU")

    found = gpu_check.probe_backends(torch.device("cpu"), smoke=smoke,
                                     import_module=_fake_imports({}))
    assert found["flash_attn"]["status"] == found["te"]["status"] == "needs CUDA"


def test_the_smoke_test_reports_a_kernel_error_with_the_te_hint(monkeypatch):
    """The real smoke test, its kernel faked: an error becomes the reason, with the cuDNN
    requirement for TE; a kernel that computes something else is caught too."""
    gpu_check = load_script("gpu_check")
    import prefix_sharing.attention as attention
    from prefix_sharing.attention.torch_backend import varlen_attention_torch

    def use(kernel):
        monkeypatch.setattr(attention, "get_backend",
                            lambda name: kernel if name == "te" else varlen_attention_torch)

    def failing(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: No valid engine configs for SDPA\ntrace")

    def wrong(*args, **kwargs):
        return 1.1 * varlen_attention_torch(*args, **kwargs)

    monkeypatch.setattr(attention, "resolve_backend", lambda name, device, dtype: name)
    cpu = torch.device("cpu")
    use(failing)
    reason = gpu_check.kernel_smoke_test("te", cpu)
    assert reason.startswith("RuntimeError: cuDNN Frontend error: No valid engine configs for SDPA")
    assert "needs cuDNN >= 9.6" in reason and "torch has cuDNN" in reason
    use(wrong)
    assert "differs from the torch kernel by" in gpu_check.kernel_smoke_test("te", cpu)
    use(varlen_attention_torch)
    assert gpu_check.kernel_smoke_test("te", cpu) is None
