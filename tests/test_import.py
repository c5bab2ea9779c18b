"""`import prefix_sharing` stays cheap: no optional framework is imported with it."""

import subprocess
import sys

OPTIONAL = ["megatron", "transformers", "verl", "flash_attn", "transformer_engine", "torch_npu",
            "mindspeed", "prefix_grouper"]


def test_core_import_pulls_in_no_optional_framework():
    code = (
        "import sys, prefix_sharing, prefix_sharing.attention, prefix_sharing.logprobs;"
        f"print([m for m in {OPTIONAL!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
