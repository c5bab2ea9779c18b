#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-0.5B-Instruct through verl's Megatron backend, prefix sharing on or
# off, for comparing step time and the prefix_sharing/* metrics on a GPU machine. Both runs use
# the same config (the sharing keys included); the environment switch alone decides:
#
#   ENABLE_PREFIX_SHARING=1 bash scripts/run_prefix_sharing.sh     # shared (default)
#   ENABLE_PREFIX_SHARING=0 bash scripts/run_prefix_sharing.sh     # verl's stock computation
#
# PREFIX_SHARING_PATCHSET (e.g. verl091_mcore0161; `prefix-sharing patchsets` lists the names for
# this machine) narrows the patch sets, as in the prototype's scripts.
#
# Data and weights are prepared as verl's GSM8K quickstart documents: verl's
# examples/data_preprocess/gsm8k.py writes train/test parquet files, and the model is fetched
# with `huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct`. Extra hydra overrides pass through.
#
# CPU mode (no GPU, no download): DEVICE=cpu bash scripts/run_prefix_sharing.sh [WORKDIR]
# builds a tiny model, tokenizer and prompts offline, runs verl's real main_ppo (tiny GRPO, 3
# steps, 2 data-parallel ranks, FSDP2) at ENABLE_PREFIX_SHARING=1 and =0 through the CPU shim in
# prefix_sharing.testing.verl_cpu, and prints the per-step comparison.
set -euo pipefail

if [ "${DEVICE:-cuda}" = cpu ]; then
  exec python3 -m prefix_sharing.testing.verl_cpu.compare "${1:-${TMPDIR:-/tmp}/prefix_sharing_cpu_demo}" \
    "${NGPUS:-2}" "${PREFIX_SHARING_MODE:-arbitrary_prefix}"
fi

DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
NGPUS=${NGPUS:-1}
ENABLE_PREFIX_SHARING=${ENABLE_PREFIX_SHARING:-1}
MODE=${PREFIX_SHARING_MODE:-arbitrary_prefix}
# verl imports prefix_sharing in every process that imports verl: the driver, which validates the
# config (prefix_grouper included), and each Ray worker (runtime_env below, to be sure).
export ENABLE_PREFIX_SHARING VERL_USE_EXTERNAL_MODULES=prefix_sharing

if [ ! -f "$DATA_DIR/train.parquet" ]; then
  echo "no $DATA_DIR/train.parquet: run verl's examples/data_preprocess/gsm8k.py --local_save_dir $DATA_DIR" >&2
  exit 2
fi

sharing=(
  ++actor_rollout_ref.actor.use_prefix_grouper=true
  "++actor_rollout_ref.actor.prefix_grouper.mode=$MODE"
  ++actor_rollout_ref.ref.use_prefix_grouper=true
  "++actor_rollout_ref.ref.prefix_grouper.mode=$MODE"
  # runtime_env reaches every Ray worker: the switch must be seen where the engines run.
  "++ray_kwargs.ray_init.runtime_env.env_vars.ENABLE_PREFIX_SHARING=$ENABLE_PREFIX_SHARING"
  "++ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=prefix_sharing"
)
if [ -n "${PREFIX_SHARING_PATCHSET:-}" ]; then
  export PREFIX_SHARING_PATCHSET
  # quoted: a comma-separated value would be a hydra list
  sharing+=("++ray_kwargs.ray_init.runtime_env.env_vars.PREFIX_SHARING_PATCHSET='$PREFIX_SHARING_PATCHSET'")
fi

python3 -m verl.trainer.main_ppo \
  --config-name=ppo_megatron_trainer \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA_DIR/train.parquet" \
  data.val_files="$DATA_DIR/test.parquet" \
  data.train_batch_size=64 \
  data.max_prompt_length=512 \
  data.max_response_length=512 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=true \
  actor_rollout_ref.model.use_fused_kernels=false \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
  trainer.logger='["console"]' \
  trainer.project_name=prefix_sharing \
  trainer.experiment_name="gsm8k_qwen05b_grpo_share${ENABLE_PREFIX_SHARING}" \
  trainer.n_gpus_per_node="$NGPUS" \
  trainer.nnodes=1 \
  trainer.total_training_steps="${STEPS:-20}" \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  "${sharing[@]}" \
  "$@"
