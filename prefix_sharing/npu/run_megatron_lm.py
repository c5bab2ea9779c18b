"""Runs a Megatron-LM entry script under MindSpeed, with prefix sharing, without editing it::

    torchrun ... -m prefix_sharing.npu.run_megatron_lm /path/Megatron-LM/pretrain_gpt.py ARGS
    torchrun ... -m prefix_sharing.npu.run_megatron_lm -m prefix_sharing.megatron_lm sft ARGS

MindSpeed must patch megatron-core before Megatron-LM initializes anything (its README asks for
``import mindspeed.megatron_adaptor`` at the top of ``pretrain_gpt.py``). This module does that
import, registers the prefix-sharing MindSpeed feature (:func:`enable_mindspeed`), then runs
the script (or, after ``-m``, the module) as ``__main__`` with the remaining arguments.
"""

from __future__ import annotations

import runpy
import sys

from .mindspeed import enable_mindspeed

__all__ = ["main"]


def main(argv: list[str]) -> None:
    """``argv``: the entry script (or ``-m MODULE``), then its arguments."""
    module = len(argv) >= 2 and argv[0] == "-m"
    if not (module or (argv and argv[0].endswith(".py"))):
        raise SystemExit("usage: python -m prefix_sharing.npu.run_megatron_lm "
                         "{SCRIPT.py | -m MODULE} [ARGS...]")
    enable_mindspeed()  # imports mindspeed.megatron_adaptor first
    if module:
        sys.argv = list(argv[1:])
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
