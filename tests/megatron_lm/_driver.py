"""``torchrun -m tests.megatron_lm._driver <kind> <args>``: the sharing entry point, recording.

Runs :func:`prefix_sharing.megatron_lm.main.main` unchanged, but wraps Megatron-LM's
``train_step`` (to keep each iteration's reduced report: ``lm loss``, the token counts) and
``train`` (to keep this rank's parameters when training ends). Each rank writes
``rank<N>.pt`` into ``$PREFIX_SHARING_TEST_OUT``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def main() -> None:
    from prefix_sharing.megatron_lm.main import main as run

    if not torch.cuda.is_available():
        from prefix_sharing.megatron_lm.cpu_support import enable_cpu_megatron_lm

        enable_cpu_megatron_lm()
    from megatron.core.utils import unwrap_model
    from megatron.training import training

    reports: list[dict[str, float]] = []
    params: dict[str, torch.Tensor] = {}
    train_step, train = training.train_step, training.train

    def recording_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        if result[0]:
            reports.append({k: float(v) for k, v in result[0].items()})
        return result

    def recording_train(forward_step_func, model, *args, **kwargs):
        result = train(forward_step_func, model, *args, **kwargs)
        for name, param in unwrap_model(model[0]).named_parameters():
            params[name] = param.detach().clone()
        return result

    training.train_step, training.train = recording_train_step, recording_train
    run(sys.argv[1:])
    out = Path(os.environ["PREFIX_SHARING_TEST_OUT"])
    rank = torch.distributed.get_rank()
    torch.save({"reports": reports, "params": params}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
