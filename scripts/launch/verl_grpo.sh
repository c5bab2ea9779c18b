#!/usr/bin/env bash
# verl GRPO with arbitrary-prefix sharing on a Ray cluster, on Ascend NPUs or NVIDIA GPUs.
#
# A Ray cluster is one head and any number of workers; the training job is submitted to the
# head once every node has joined. Run with the same arguments on every node: the first host in
# --nodes starts the Ray head, the others join it as workers; then, on the head, run again with
# --role submit. --dry-run prints all of it (each node's Ray start, then the job) and runs nothing.
#
#   scripts/launch/verl_grpo.sh --device ascend --nodes n0,n1 --model /models/Qwen2.5-7B \
#       --train-files /data/gsm8k/train.parquet --val-files /data/gsm8k/test.parquet --dry-run
#
# Every option also reads an environment variable (shown in brackets). Hydra overrides after
# "--" go to verl.trainer.main_ppo unchanged.
set -euo pipefail
# shellcheck source=scripts/launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<'USAGE'
usage: verl_grpo.sh [options] [-- verl hydra overrides]
  --device ascend|cuda      accelerator [DEVICE, default cuda]
  --nodes h0,h1,...         hosts; the first runs the Ray head [NODES, default this host]
  --role head|worker|submit what to do on this node [ROLE, default head on the first host,
                            worker elsewhere]
  --nproc-per-node N        devices per node [NPROC_PER_NODE, default 8]
  --ray-port PORT           Ray head port [RAY_PORT, default 6379]
  --dashboard-port PORT     Ray dashboard / job API port [DASHBOARD_PORT, default 8265]
  --model PATH              HuggingFace model (actor, reference, rollout) [MODEL_PATH]
  --train-files FILE        training parquet [TRAIN_FILES]
  --val-files FILE          validation parquet [VAL_FILES]
  --strategy megatron|fsdp  actor engine (fsdp runs FSDP2) [STRATEGY, default megatron]
  --tp N / --pp N           actor tensor / pipeline parallel sizes (megatron) [TP / PP, default 1]
  --group-size N            responses per prompt (GRPO group) [GROUP_SIZE, default 8]
  --python BIN              interpreter [PYTHON, default python3]
  --dry-run                 print every node's environment and command, run nothing
USAGE
}

DEVICE=${DEVICE:-cuda}
NODES_ARG=${NODES:-}
ROLE=${ROLE:-}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
RAY_PORT=${RAY_PORT:-6379}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
MODEL_PATH=${MODEL_PATH:-}
TRAIN_FILES=${TRAIN_FILES:-}
VAL_FILES=${VAL_FILES:-}
STRATEGY=${STRATEGY:-megatron}
TP=${TP:-1}
PP=${PP:-1}
GROUP_SIZE=${GROUP_SIZE:-8}
PYTHON=${PYTHON:-python3}
DRY_RUN=0
EXTRA=()

while (($#)); do
    case $1 in
        --device) DEVICE=$2; shift 2 ;;
        --nodes) NODES_ARG=$2; shift 2 ;;
        --role) ROLE=$2; shift 2 ;;
        --nproc-per-node) NPROC_PER_NODE=$2; shift 2 ;;
        --ray-port) RAY_PORT=$2; shift 2 ;;
        --dashboard-port) DASHBOARD_PORT=$2; shift 2 ;;
        --model) MODEL_PATH=$2; shift 2 ;;
        --train-files) TRAIN_FILES=$2; shift 2 ;;
        --val-files) VAL_FILES=$2; shift 2 ;;
        --strategy) STRATEGY=$2; shift 2 ;;
        --tp) TP=$2; shift 2 ;;
        --pp) PP=$2; shift 2 ;;
        --group-size) GROUP_SIZE=$2; shift 2 ;;
        --python) PYTHON=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

case $DEVICE in
    ascend) TRAINER_DEVICE=npu ;;
    cuda) TRAINER_DEVICE=cuda ;;
    *) die "--device must be ascend or cuda, got '$DEVICE'" ;;
esac
case $STRATEGY in
    megatron) CONFIG_NAME=ppo_megatron_trainer ;;
    fsdp) CONFIG_NAME=ppo_trainer ;;
    *) die "--strategy must be megatron or fsdp, got '$STRATEGY'" ;;
esac
case ${ROLE:-auto} in
    auto | head | worker | submit) ;;
    *) die "--role must be head, worker or submit, got '$ROLE'" ;;
esac
need "$MODEL_PATH" --model
need "$TRAIN_FILES" --train-files
need "$VAL_FILES" --val-files
positive_int "$NPROC_PER_NODE" --nproc-per-node
positive_int "$TP" --tp
positive_int "$PP" --pp
positive_int "$GROUP_SIZE" --group-size
split_nodes "${NODES_ARG:-$(hostname -s 2>/dev/null || hostname)}"
HEAD=${NODES[0]}

# The devices a node offers Ray: Ascend NPUs are Ray's "NPU" resource, GPUs its --num-gpus.
device_env() {
    NODE_ENV=()
    if [[ $DEVICE == ascend ]]; then
        ascend_env "$NPROC_PER_NODE"
    else
        cuda_env "$NPROC_PER_NODE"
    fi
}

ray_devices() {
    if [[ $DEVICE == ascend ]]; then
        NODE_CMD+=(--resources "{\"NPU\": $NPROC_PER_NODE}")
    else
        NODE_CMD+=(--num-gpus "$NPROC_PER_NODE")
    fi
}

head_command() {
    device_env
    NODE_CMD=(ray start --head --node-ip-address "$HEAD" --port "$RAY_PORT"
        --dashboard-host 0.0.0.0 --dashboard-port "$DASHBOARD_PORT")
    ray_devices
}

worker_command() {
    device_env
    NODE_CMD=(ray start --address "$HEAD:$RAY_PORT")
    ray_devices
}

# The GRPO job: verl's trainer with prefix sharing switched on. VERL_USE_EXTERNAL_MODULES makes
# the driver import prefix_sharing before it validates the actor config (which holds
# prefix_grouper), external_lib makes every verl worker import it; the two prefix_grouper
# settings ask for sharing of every common prefix (not only the prompt).
submit_command() {
    NODE_ENV=()  # the ranks inherit the environment of each node's Ray start, not the submitter's
    NODE_CMD=(ray job submit --address "http://$HEAD:$DASHBOARD_PORT" --
        env VERL_USE_EXTERNAL_MODULES=prefix_sharing
        "$PYTHON" -m verl.trainer.main_ppo --config-name "$CONFIG_NAME"
        algorithm.adv_estimator=grpo
        "data.train_files=$TRAIN_FILES" "data.val_files=$VAL_FILES"
        "actor_rollout_ref.model.path=$MODEL_PATH"
        actor_rollout_ref.model.external_lib=prefix_sharing
        actor_rollout_ref.actor.use_prefix_grouper=true
        +actor_rollout_ref.actor.prefix_grouper.mode=arbitrary_prefix
        "actor_rollout_ref.rollout.n=$GROUP_SIZE"
        "trainer.device=$TRAINER_DEVICE"
        "trainer.nnodes=${#NODES[@]}" "trainer.n_gpus_per_node=$NPROC_PER_NODE"
    )
    if [[ $STRATEGY == megatron ]]; then
        NODE_CMD+=(
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TP"
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$PP"
        )
    else  # FSDP2: the engine prefix sharing is tested with (verl's default is FSDP1)
        NODE_CMD+=(actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2)
    fi
    NODE_CMD+=("${EXTRA[@]}")
}

if ((DRY_RUN)); then
    head_command
    launch_node "node 0 ($HEAD): Ray head, $DEVICE, $NPROC_PER_NODE devices"
    for rank in "${!NODES[@]}"; do
        ((rank > 0)) || continue
        worker_command
        launch_node "node $rank (${NODES[$rank]}): Ray worker, $DEVICE, $NPROC_PER_NODE devices"
    done
    submit_command
    launch_node "job, submitted on node 0 ($HEAD) once all ${#NODES[@]} nodes have joined"
    exit 0
fi
if [[ -z "$ROLE" ]]; then
    NODE_RANK=$(this_node_rank)
    if ((NODE_RANK == 0)); then ROLE="head"; else ROLE="worker"; fi
fi
"${ROLE}_command"
launch_node "$ROLE"
