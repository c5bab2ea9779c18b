"""Per-step comparison of two tiny GRPO runs (sharing on against ``ENABLE_PREFIX_SHARING=0``),
for the end-to-end tests and the demo script (``python -m prefix_sharing.testing.verl_cpu.compare
WORKDIR``: runs both and prints the table)."""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

from .runner import TrainerRun, run_main_ppo, tiny_grpo_overrides

COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
RATIO = "actor/prefix_sharing/token_ratio"
# the trainer's data-parallel partition: the token ratio its ranks compute, and the ideal
DP_RATIO, DP_IDEAL = "prefix_sharing/dp_token_ratio", "prefix_sharing/dp_ideal_token_ratio"


# what verl 0.9.1's trainer imports beyond torch and this package (the [verl] extra brings them)
TRAINER_MODULES = ("verl", "transfer_queue", "pandas", "ray", "uvicorn", "fastapi", "openai",
                   "msgspec")


def missing_modules() -> list[str]:
    """The modules of :data:`TRAINER_MODULES` this environment lacks."""
    return [name for name in TRAINER_MODULES if importlib.util.find_spec(name) is None]


def rollouts_by_prompt(generations: list[dict]) -> dict[str, list[str]]:
    """A step's responses per prompt, sorted: which member of a GRPO group got which response
    follows request order, which verl's agent loop does not fix (see ``rollout.py``)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for sample in generations:
        groups[sample["input"]].append(sample["output"])
    return {prompt: sorted(outputs) for prompt, outputs in groups.items()}


def relative_diff(a: float, b: float, floor: float = 1e-6) -> float:
    return abs(a - b) / max(abs(a), abs(b), floor)


def table(on: TrainerRun, off: TrainerRun) -> str:
    """One row per step: the token ratio the ranks computed (and the ideal, every group whole on
    one rank), step time on and off, and each compared figure's
    difference - absolute for pg_loss and KL (both ~0 in on-policy GRPO's first update, so a
    relative figure would only measure rounding), relative for entropy and grad_norm."""
    header = (f"{'step':>4} {'token_ratio':>11} {'ideal':>6} {'step_s on':>9} {'step_s off':>10} "
              f"{'pg_loss |d|':>11} {'kl |d|':>9} {'entropy rel':>11} {'grad_norm rel':>13}")
    lines = [header]
    for step, (a, b) in enumerate(zip(on.steps, off.steps), start=1):
        pg, kl, entropy, grad = (a[name] - b[name] for name in COMPARED)
        ratio, ideal = a.get(DP_RATIO, float("nan")), a.get(DP_IDEAL, float("nan"))
        lines.append(
            f"{step:>4} {ratio:>11.3f} {ideal:>6.3f} {a['timing_s/step']:>9.2f} "
            f"{b['timing_s/step']:>10.2f} {abs(pg):>11.1e} {abs(kl):>9.1e} "
            f"{relative_diff(a[COMPARED[2]], b[COMPARED[2]]):>11.1e} "
            f"{relative_diff(a[COMPARED[3]], b[COMPARED[3]]):>13.1e}")
    return "\n".join(lines)


def main(workdir: str, n_ranks: int = 2, mode: str = "arbitrary_prefix") -> None:
    root = Path(workdir)
    overrides = tiny_grpo_overrides(root / "assets", n_ranks=n_ranks, mode=mode)
    on = run_main_ppo(root / "on", overrides, enable_sharing=True)
    off = run_main_ppo(root / "off", overrides, enable_sharing=False)
    print(f"tiny GRPO, verl main_ppo on CPU, {n_ranks} ranks, mode {mode}: "
          f"wall {on.wall_s:.0f} s on, {off.wall_s:.0f} s off")
    print(table(on, off))


def demo(argv: list[str]) -> int:
    """``scripts/run_prefix_sharing.sh``'s CPU mode: one line and exit 2 outside verl's
    environment, one line and exit 1 when a run outlasts its timeout (a busy machine), else
    :func:`main`'s table."""
    if missing := missing_modules():
        print(f"DEVICE=cpu runs verl 0.9.1's trainer, which needs {', '.join(missing)} here: "
              "build its environment first (torch, then pip install -e '.[verl]': README, "
              "\"See it in verl's real trainer\")", file=sys.stderr)
        return 2
    try:
        main(argv[0], *(int(a) if a.isdigit() else a for a in argv[1:]))
    except TimeoutError as error:  # a busy machine: the run takes ~2 min on an idle one
        print(f"{error} (about 2 min on an idle 2-core machine: is this one busy?)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(demo(sys.argv[1:]))
