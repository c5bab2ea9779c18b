"""Launch verl's real ``python -m verl.trainer.main_ppo`` on CPU through this shim and read its
per-step metrics (verl's file logger) and generations (``trainer.rollout_data_dir``) back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .assets import make_tiny_assets

SHIM = "prefix_sharing.testing.verl_cpu"
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"


def tiny_grpo_overrides(assets_root: str | Path, *, n_ranks: int = 2, steps: int = 3,
                        mode: str = "arbitrary_prefix", rollout_n: int = 4,
                        critic: bool = False, strategy: str = "fsdp2",
                        tensor_parallel: int = 1) -> list[str]:
    """The tiny GRPO: actor and reference (KL loss), greedy branch rollouts, the toy reward,
    every setting as short as verl allows; sharing configured (on unless
    ``ENABLE_PREFIX_SHARING=0``). ``strategy``: ``fsdp2``, or ``megatron`` (verl's Megatron
    engine through the vanilla mbridge, ``tensor_parallel`` ways, the rest data-parallel; see
    :mod:`.megatron`). ``critic``: PPO with GAE instead, an FSDP2 critic (a value head on the
    same tiny model) sharing too."""
    assets = make_tiny_assets(assets_root)
    prompts_per_step = 2 * n_ranks
    critic_section = [
        "critic.strategy=fsdp2", f"critic.model.path={assets.model}",
        "critic.model.use_remove_padding=true",
        "+critic.model.override_config.attn_implementation=sdpa",
        "critic.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-4",
        f"++critic.fsdp.mixed_precision={FP32}",
        "++critic.use_prefix_grouper=true", f"++critic.prefix_grouper.mode={mode}",
    ] if critic else []
    return [
        *ENGINE_SECTIONS[strategy](tensor_parallel),
        f"algorithm.adv_estimator={'gae' if critic else 'grpo'}", *critic_section,
        f"data.train_files={assets.train_files}", f"data.val_files={assets.val_files}",
        f"data.train_batch_size={prompts_per_step}", "data.max_prompt_length=96",
        "data.max_response_length=8", "data.dataloader_num_workers=0", "data.shuffle=false",
        f"actor_rollout_ref.model.path={assets.model}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.calculate_entropy=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts_per_step}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.name=hf", f"actor_rollout_ref.rollout.n={rollout_n}",
        # verl divides the trainer's logits by rollout.temperature too: keep it 1 (the shim's
        # rollout is deterministic at any temperature, see rollout.py)
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={n_ranks}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "++actor_rollout_ref.actor.use_prefix_grouper=true",
        f"++actor_rollout_ref.actor.prefix_grouper.mode={mode}",
        "++actor_rollout_ref.ref.use_prefix_grouper=true",
        f"++actor_rollout_ref.ref.prefix_grouper.mode={mode}",
        f"reward.custom_reward_function.path={assets.reward}",
        "reward.custom_reward_function.name=compute_score", "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        "trainer.device=cpu", f"trainer.n_gpus_per_node={n_ranks}", "trainer.nnodes=1",
        "trainer.logger=[console,file]", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=100",
        "trainer.project_name=tiny", "trainer.experiment_name=grpo",
        f"+ray_kwargs.ray_init.num_gpus={n_ranks}", "+ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "+ray_kwargs.ray_init.resources.cpu=16",
    ]


def _fsdp2_section(tensor_parallel: int) -> list[str]:
    if tensor_parallel != 1:
        raise ValueError("the FSDP2 engines are data-parallel only here: tensor_parallel=1")
    return [
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.param_offload=false",
        # fp32 throughout (verl's FSDP default computes in bf16): the comparisons are fp32's
        f"++actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
        f"++actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
    ]


def _megatron_section(tensor_parallel: int) -> list[str]:
    """verl's Megatron config (``model_engine=megatron``), the vanilla-mbridge route, fp32 (the
    shim lets ``float32`` through verl's bf16/fp16 check: :mod:`.megatron`)."""
    section = ["model_engine=megatron"]
    for role in ("actor", "ref"):
        prefix = f"actor_rollout_ref.{role}.megatron"
        section += [f"{prefix}.dtype=float32", f"{prefix}.use_mbridge=true",
                    f"{prefix}.vanilla_mbridge=true",
                    f"{prefix}.tensor_model_parallel_size={tensor_parallel}"]
    return section


ENGINE_SECTIONS = {"fsdp2": _fsdp2_section, "megatron": _megatron_section}


@dataclass
class TrainerRun:
    """One finished ``main_ppo`` run: its metrics per step (``steps[i]`` is step i + 1), its
    dumped generations per step, the wall time and the directory it ran in."""

    workdir: Path
    steps: list[dict[str, float]]
    generations: list[list[dict]] = field(default_factory=list)
    token_log: list[dict] = field(default_factory=list)
    wall_s: float = 0.0


def child_env(enable_sharing: bool, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the driver, which Ray's workers inherit: the shim and this project
    importable, the CPU platform, one torch thread per process."""
    root = str(Path(__file__).resolve().parents[3])
    base = dict(os.environ)
    base.update({
        "VERL_USE_EXTERNAL_MODULES": SHIM, "VERL_PLATFORM": "cpu",
        "ENABLE_PREFIX_SHARING": "1" if enable_sharing else "0",
        "PYTHONPATH": os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1",
    })
    base.update(env or {})
    return base


def run_trainer(command: list[str], workdir: Path, env: dict[str, str], name: str,
                timeout_s: float) -> tuple[float, list[dict[str, float]]]:
    """Run one of verl's trainers (``command``) in ``workdir``, its output in ``<name>.log``;
    its wall time and per-step metrics (verl's file logger, which ``env`` points at
    ``workdir/metrics.jsonl``). Raises with the log's tail if it fails, and ``TimeoutError``
    naming its log if it outlasts ``timeout_s``."""
    log_path = workdir / f"{name}.log"
    metrics_file = workdir / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        with open(log_path, "w") as log:
            result = subprocess.run(command, cwd=workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        raise TimeoutError(f"verl's {name} did not finish within {timeout_s:.0f} s; its log: "
                           f"{log_path}") from error
    wall = time.monotonic() - start
    if result.returncode != 0:
        raise RuntimeError(f"{name} exited {result.returncode} in {workdir}:\n"
                           f"{log_path.read_text()[-6000:]}")
    return wall, [json.loads(line)["data"] for line in metrics_file.read_text().splitlines()
                  if line]


def run_main_ppo(workdir: str | Path, overrides: list[str], env: dict[str, str] | None = None,
                 *, enable_sharing: bool = True, timeout_s: float = 900) -> TrainerRun:
    """Run the trainer in ``workdir``; raise with the log's tail if it fails, and
    ``TimeoutError`` naming its log if it outlasts ``timeout_s``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_file = workdir / "metrics.jsonl"
    rollouts = workdir / "rollouts"
    child = child_env(enable_sharing, env)
    child["VERL_FILE_LOGGER_PATH"] = str(metrics_file)
    token_log = workdir / "rollout_tokens.jsonl"
    child["PREFIX_SHARING_CPU_ROLLOUT_LOG"] = str(token_log)
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides,
               f"trainer.rollout_data_dir={rollouts}",
               f"trainer.default_local_dir={workdir / 'checkpoints'}"]
    token_log.unlink(missing_ok=True)
    wall, steps = run_trainer(command, workdir, child, "main_ppo", timeout_s)
    generations = [[json.loads(line) for line in path.read_text().splitlines() if line]
                   for path in sorted(rollouts.glob("*.jsonl"), key=lambda p: int(p.stem))]
    tokens = [json.loads(line) for line in token_log.read_text().splitlines() if line]
    return TrainerRun(workdir, steps, generations, tokens, wall)
