"""`import prefix_sharing` stays cheap: no optional framework is imported with it.

It does activate the verl integration, but only as a finder on ``sys.meta_path`` that acts when
verl's own modules are imported (``prefix_sharing.verl_ext.activation``).
"""

import os
import subprocess
import sys

OPTIONAL = ["megatron", "transformers", "verl", "flash_attn", "transformer_engine", "torch_npu",
            "mindspeed", "prefix_grouper", "fla"]

FINDERS = "[type(f).__name__ for f in sys.meta_path if 'prefix_sharing' in type(f).__module__]"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ENABLE_PREFIX_SHARING"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environ, **env})


def test_core_import_pulls_in_no_optional_framework():
    code = (
        "import sys, prefix_sharing, prefix_sharing.attention, prefix_sharing.logprobs,"
        " prefix_sharing.recurrent;"
        f"print([m for m in {OPTIONAL!r} if m in sys.modules])"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_import_activates_the_verl_integration_lazily():
    out = _python(f"import sys, prefix_sharing; print({FINDERS}, 'verl' in sys.modules)")
    assert out.stdout.split() == ["['_PatchFinder']", "False"], out.stderr


def test_enable_prefix_sharing_0_switches_sharing_off_and_a_bad_value_is_refused():
    """At 0 the finder still goes in (verl's config must accept the sharing keys, see
    verl_ext/switched_off.py), with sharing off; verl is still not imported."""
    off = _python(f"import sys, prefix_sharing; print({FINDERS}, prefix_sharing.setup.enabled(), "
                  "'verl' in sys.modules)", ENABLE_PREFIX_SHARING="0")
    assert off.stdout.split() == ["['_PatchFinder']", "False", "False"], off.stderr
    bad = _python("import prefix_sharing", ENABLE_PREFIX_SHARING="yes")
    assert bad.returncode != 0
    assert "ENABLE_PREFIX_SHARING must be 0 or 1; got 'yes'" in bad.stderr
