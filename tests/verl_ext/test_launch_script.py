"""The launch-script reader gives the hydra overrides bash would pass to verl, read from
realistic scripts (verl 0.9's examples' shapes): ``\\`` continuations, assignments with
defaults, exported variables, single quotes left alone, ``"$@"``, a pipe to ``tee``."""

import pytest

from prefix_sharing.verl_ext.launch_script import read_launch_script

GRPO = r"""#!/usr/bin/env bash
set -xeuo pipefail
# GRPO on gsm8k, Megatron
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
export TP=${TP:-2}
gsm8k_train=$HOME/data/gsm8k/train.parquet
project_name='verl_grpo_example'
NOW=$(date +%Y%m%d)

python3 -m verl.trainer.main_ppo --config-path=config \
    --config-name='ppo_megatron_trainer.yaml' \
    algorithm.adv_estimator=grpo \
    data.train_files="['$gsm8k_train']" \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TP \
    actor_rollout_ref.actor.use_kl_loss=True   `# an inline comment` \
    trainer.project_name=$project_name \
    trainer.experiment_name='qwen3_$NOW' \
    trainer.run_id=$NOW \
    "$@" 2>&1 | tee run.log
"""

SFT = r"""set -x
nproc_per_node=$1
save_path=$2
shift 2
torchrun --standalone --nnodes=1 --nproc_per_node=$nproc_per_node \
     -m verl.trainer.sft_trainer \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    model.path=Qwen/Qwen2.5-0.5B-Instruct \
    engine=fsdp engine.strategy=fsdp2 \
    trainer.default_local_dir=$save_path $@
"""


def read(tmp_path, text, args=()):
    script = tmp_path / "run.sh"
    script.write_text(text)
    return read_launch_script(str(script), list(args))


def test_a_megatron_grpo_script_gives_its_overrides_with_variables_resolved(tmp_path):
    launch = read(tmp_path, GRPO, ["actor_rollout_ref.actor.use_prefix_grouper=true",
                                   "trainer.n_gpus_per_node=8"])
    assert launch.module == "verl.trainer.main_ppo"
    assert launch.config_name == "ppo_megatron_trainer" and launch.config_path == "config"
    assert launch.overrides == [
        "algorithm.adv_estimator=grpo",
        "data.train_files=['$HOME/data/gsm8k/train.parquet']",
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "trainer.project_name=verl_grpo_example",
        "trainer.experiment_name=qwen3_$NOW",  # single quotes: bash does not expand it
        "trainer.run_id=$NOW",
        "actor_rollout_ref.actor.use_prefix_grouper=true",  # "$@": one word per argument
        "trainer.n_gpus_per_node=8",
    ]
    assert launch.unresolved == ["$HOME", "$NOW"]


def test_an_sft_script_under_torchrun_with_positional_arguments_and_shift(tmp_path):
    launch = read(tmp_path, SFT, ["8", "/ckpt", "trainer.total_epochs=1"])
    assert launch.module == "verl.trainer.sft_trainer" and launch.config_name is None
    assert launch.overrides == [
        "data.train_files=$HOME/data/gsm8k/train.parquet",
        "model.path=Qwen/Qwen2.5-0.5B-Instruct", "engine=fsdp", "engine.strategy=fsdp2",
        "trainer.default_local_dir=/ckpt", "trainer.total_epochs=1"]  # $@ after shift 2
    assert read(tmp_path, SFT).overrides[-1] == "trainer.default_local_dir=$2"  # no arguments


ARRAYS = r"""max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
ACTOR=(
    actor_rollout_ref.actor.strategy=megatron
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((max_prompt_length + max_response_length))
)
ACTOR+=(actor_rollout_ref.actor.use_kl_loss=True)
DATA="data.max_prompt_length=${max_prompt_length} data.max_response_length=${max_response_length}"
PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
    "${ACTOR[@]}" \
    $DATA \
    "${UNSET_ARRAY[@]}"
"""


def test_arrays_arithmetic_word_splitting_and_an_environment_prefix(tmp_path):
    """verl 0.9's newer examples: bash arrays (over several lines, appended to), ``$((...))``,
    a string of overrides split into words, ``VAR=1 python3 -m ...``."""
    launch = read(tmp_path, ARRAYS)
    assert launch.module == "verl.trainer.main_ppo"
    assert launch.overrides == [
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "data.max_prompt_length=2048", "data.max_response_length=8192"]
    assert launch.unresolved == ["${UNSET_ARRAY[@]}"]


BRANCHES = r"""DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}
case "${DEVICE}" in
    gpu)
        ATTN=flash_attention_2
        ;;
    npu)
        ATTN=eager
        ;;
esac
if [ "$DEVICE" == "npu" ]; then
    STRATEGY=megatron
else
    STRATEGY=fsdp2
fi
python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.strategy=$STRATEGY \
    +actor_rollout_ref.model.override_config.attn_implementation=$ATTN
"""


def test_the_gpu_branch_of_a_device_switch_is_read(tmp_path):
    launch = read(tmp_path, BRANCHES)
    assert launch.overrides == [
        "actor_rollout_ref.actor.strategy=fsdp2",
        "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2"]


def test_a_script_without_a_verl_module_is_bad_input(tmp_path):
    with pytest.raises(ValueError, match="runs no verl module"):
        read(tmp_path, "echo hello\npython3 train.py a=1\n")
