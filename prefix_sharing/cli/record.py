"""``prefix-sharing bench --record FILE.json``: the run saved as a result file of docs/results.

The benchmarks page is generated from result files (``scripts/docs/benchmarks_page.py``), one
per measurement, each carrying what reproduces it. Written by hand, a result's command, date or
machine goes missing; recorded here they are filled from the run itself: the command line
(``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in front when set, ``--record`` left out), the UTC
time, the machine (platform, CPU count, torch's threads, the load average - what else ran -
and the accelerator) and the versions of the packages the step ran on. The figures are the
bench's own ``--json`` report (``payload``) and its table as printed (``output``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

# The distributions whose release changes what a bench step runs (those installed are recorded).
PACKAGES = ("prefix-sharing", "torch", "megatron-core", "transformers", "verl", "flash-attn",
            "transformer-engine", "torch-npu")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def command_line(argv: Sequence[str]) -> str:
    """The command that reproduces the run: ``prefix-sharing`` and its arguments, less
    ``--record``, with the thread settings of the environment in front."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--record":
            skip = True
        elif not arg.startswith("--record="):
            kept.append(arg)
    env = [f"{name}={os.environ[name]}" for name in THREAD_VARIABLES if name in os.environ]
    return " ".join([*env, "prefix-sharing", shlex.join(kept)])


def machine() -> dict[str, str | int]:
    """Where the run happened, as far as the process can tell."""
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"platform": platform.platform(), "cpus": os.cpu_count() or 0,
            "torch threads": torch.get_num_threads(),
            "load average (1 min)": f"{os.getloadavg()[0]:.2f}", "accelerator": accelerator}


def versions() -> dict[str, str]:
    """Python and every installed distribution of :data:`PACKAGES`, with its version."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def write_result(path: str | os.PathLike, argv: Sequence[str], title: str, report: dict,
                 output: str) -> None:
    """Writes (or replaces) the result file ``path`` for this run."""
    result = {"title": title, "command": command_line(argv),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine(), "versions": versions(), "output": output,
              "payload": report}
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
