"""verl's real SFT trainer (``python -m verl.trainer.sft_trainer``) on CPU through this shim:
a multi-turn chat dataset whose conversations share a long system prompt, the overrides of a
tiny fp32 run, and a launcher that reads its per-step metrics back (verl's file logger).

The trainer is launched under ``torch.distributed.run`` (it calls
``initialize_global_process_group``, which reads torchrun's environment); the shim's process
group backend (gloo) and CPU platform apply as for ``main_ppo`` (:mod:`.patches`). No Ray.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .assets import WORDS, make_tiny_assets
from .runner import FP32, TrainerRun, child_env, run_trainer

SYSTEM_WORDS = 60  # the shared system prompt: ~250 tokens after the tiny BPE


def write_conversations(path: str | Path, num_conversations: int = 8, seed: int = 0) -> Path:
    """A parquet of ``messages`` (verl's ``MultiTurnSFTDataset`` layout): every conversation
    opens with the same system prompt, then two user / assistant turns of its own."""
    import random

    import pandas as pd

    path = Path(path)
    if path.exists():
        return path
    rng = random.Random(seed)
    system = "You are a careful assistant. " + " ".join(rng.choice(WORDS)
                                                         for _ in range(SYSTEM_WORDS))

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    rows = [{"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Question {index}: {words(6 + index % 5)}"},
        {"role": "assistant", "content": words(4 + index % 3)},
        {"role": "user", "content": words(3 + index % 4)},
        {"role": "assistant", "content": words(5)},
    ]} for index in range(num_conversations)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def tiny_sft_overrides(assets_root: str | Path, *, n_ranks: int = 1, steps: int = 3,
                       engine: str = "fsdp", mode: str = "arbitrary_prefix") -> list[str]:
    """A tiny fp32 SFT run: 4 conversations per step in micro-batches of 2 per rank, FSDP2,
    the packed layout, no validation, no checkpoint; sharing configured in the engine section
    (on unless ``ENABLE_PREFIX_SHARING=0``)."""
    assets = make_tiny_assets(assets_root)
    data = write_conversations(Path(assets_root) / "sft_train.parquet")
    overrides = [
        f"data.train_files={data}", "data.val_files=null", f"data.train_batch_size={4 * n_ranks}",
        "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=false", "data.max_length=512",
        "data.num_workers=0", "data.pad_mode=no_padding",
        f"model.path={assets.model}", "model.use_remove_padding=true",
        "+model.override_config.attn_implementation=sdpa",
        "optim.lr=1e-3",
        f"engine={engine}",
        "+engine.use_prefix_grouper=true", f"+engine.prefix_grouper.mode={mode}",
        "trainer.device=cpu", "trainer.logger=[console,file]",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.resume_mode=disable", f"trainer.n_gpus_per_node={n_ranks}",
        "trainer.project_name=tiny", "trainer.experiment_name=sft",
    ]
    if engine == "fsdp":  # fp32 throughout (verl's FSDP default computes in bf16)
        overrides += ["engine.strategy=fsdp2", "engine.use_torch_compile=false",
                      f"++engine.mixed_precision={FP32}"]
    return overrides


def run_sft_trainer(workdir: str | Path, overrides: list[str], *, n_ranks: int = 1,
                    enable_sharing: bool = True, timeout_s: float = 600) -> TrainerRun:
    """Run verl's SFT trainer in ``workdir`` on ``n_ranks`` gloo processes; raise with the
    log's tail if it fails."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    child = child_env(enable_sharing)
    child["VERL_FILE_LOGGER_PATH"] = str(workdir / "metrics.jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n_ranks}", "-m", "verl.trainer.sft_trainer", *overrides,
               f"trainer.default_local_dir={workdir / 'checkpoints'}"]
    wall, steps = run_trainer(command, workdir, child, "sft_trainer", timeout_s)
    return TrainerRun(workdir, steps, wall_s=wall)
