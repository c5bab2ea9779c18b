#!/usr/bin/env bash
# Multi-node Megatron-LM training with prefix sharing, on Ascend NPUs (MindSpeed, HCCL) or NVIDIA
# GPUs (NCCL): Megatron-LM's own pretrain() through the sharing entry point
# (python -m prefix_sharing.megatron_lm sft|gpt), which plans every micro-batch. Run it on every
# node with the same arguments; each node finds its rank in --nodes (or takes --node-rank).
# torchrun starts the ranks; Megatron-LM's arguments after "--" are passed through (model shape,
# batch, schedule, --prefix-sharing-* settings).
#
#   scripts/launch/megatron_train.sh --device cuda --nodes n0,n1 --kind sft \
#       --data-path /data/conversations.jsonl --tokenizer-model /models/Qwen2.5-7B \
#       --dry-run -- --num-layers 28 --hidden-size 3584 ...
#
# The entry point follows megatron.training as megatron-core >= 0.17 ships it (or a Megatron-LM
# checkout of that age, --megatron-lm). Every option also reads an environment variable (shown
# in brackets).
set -euo pipefail
# shellcheck source=scripts/launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<'USAGE'
usage: megatron_train.sh [options] [-- Megatron-LM arguments]
  --device ascend|cuda      accelerator [DEVICE, default cuda]
  --kind sft|gpt            sft: Megatron-LM's SFT dataset (--data-path conversations JSONL);
                            gpt: a rollout / trajectory file (--trajectories) [KIND, default sft]
  --nodes h0,h1,...         hosts, the first is the master [NODES, default this host]
  --node-rank N             this node's index in --nodes [NODE_RANK, default: found by hostname]
  --nproc-per-node N        ranks (devices) per node [NPROC_PER_NODE, default 8]
  --master-addr ADDR        rendezvous host [MASTER_ADDR, default the first node]
  --master-port PORT        rendezvous port [MASTER_PORT, default 6000]
  --rank-table FILE         Ascend HCCL rank table, exported as RANK_TABLE_FILE [RANK_TABLE_FILE]
  --megatron-lm DIR         a Megatron-LM checkout to put first on PYTHONPATH [MEGATRON_LM,
                            default: the megatron.training inside megatron-core]
  --data-path FILE          sft: conversations JSONL ({"messages": [...]} lines) [DATA_PATH]
  --trajectories FILE       gpt: rollouts, JSONL or Parquet [TRAJECTORIES]
  --tokenizer-model PATH    HuggingFace tokenizer [TOKENIZER_MODEL]
  --save DIR / --load DIR   checkpoints [SAVE_DIR / LOAD_DIR]
  --tp N / --pp N           tensor / pipeline parallel sizes [TP / PP, default 1]
  --python BIN              interpreter [PYTHON, default python3]
  --dry-run                 print every node's environment and command, run nothing
USAGE
}

DEVICE=${DEVICE:-cuda}
KIND=${KIND:-sft}
TRAJECTORIES=${TRAJECTORIES:-}
NODES_ARG=${NODES:-}
NODE_RANK=${NODE_RANK:-}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-}
MASTER_PORT=${MASTER_PORT:-6000}
RANK_TABLE_FILE=${RANK_TABLE_FILE:-}
MEGATRON_LM=${MEGATRON_LM:-}
DATA_PATH=${DATA_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
SAVE_DIR=${SAVE_DIR:-}
LOAD_DIR=${LOAD_DIR:-}
TP=${TP:-1}
PP=${PP:-1}
PYTHON=${PYTHON:-python3}
DRY_RUN=0
EXTRA=()

while (($#)); do
    case $1 in
        --device) DEVICE=$2; shift 2 ;;
        --kind) KIND=$2; shift 2 ;;
        --trajectories) TRAJECTORIES=$2; shift 2 ;;
        --nodes) NODES_ARG=$2; shift 2 ;;
        --node-rank) NODE_RANK=$2; shift 2 ;;
        --nproc-per-node) NPROC_PER_NODE=$2; shift 2 ;;
        --master-addr) MASTER_ADDR=$2; shift 2 ;;
        --master-port) MASTER_PORT=$2; shift 2 ;;
        --rank-table) RANK_TABLE_FILE=$2; shift 2 ;;
        --megatron-lm) MEGATRON_LM=$2; shift 2 ;;
        --data-path) DATA_PATH=$2; shift 2 ;;
        --tokenizer-model) TOKENIZER_MODEL=$2; shift 2 ;;
        --save) SAVE_DIR=$2; shift 2 ;;
        --load) LOAD_DIR=$2; shift 2 ;;
        --tp) TP=$2; shift 2 ;;
        --pp) PP=$2; shift 2 ;;
        --python) PYTHON=$2; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h | --help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

case $DEVICE in
    ascend | cuda) ;;
    *) die "--device must be ascend or cuda, got '$DEVICE'" ;;
esac
case $KIND in
    sft) need "$DATA_PATH" --data-path ;;
    gpt) need "$TRAJECTORIES" --trajectories ;;
    *) die "--kind must be sft or gpt, got '$KIND'" ;;
esac
need "$TOKENIZER_MODEL" --tokenizer-model
positive_int "$NPROC_PER_NODE" --nproc-per-node
positive_int "$TP" --tp
positive_int "$PP" --pp
[[ -z "$RANK_TABLE_FILE" || "$DEVICE" == ascend ]] || die "--rank-table is for --device ascend"
split_nodes "${NODES_ARG:-$(hostname -s 2>/dev/null || hostname)}"
MASTER_ADDR=${MASTER_ADDR:-${NODES[0]}}

# Ascend: MindSpeed must patch megatron-core before Megatron-LM starts; run_megatron_lm imports
# it and registers the prefix-sharing MindSpeed feature, then runs the sharing entry point, and
# the NPU spec module builds the spec from MindSpeed's classes.
if [[ $DEVICE == ascend ]]; then
    ENTRY=(-m prefix_sharing.npu.run_megatron_lm -m prefix_sharing.megatron_lm "$KIND")
    SPEC_MODULE=prefix_sharing.npu.megatron_lm_spec
    TRANSFORMER_IMPL=local
else
    ENTRY=(-m prefix_sharing.megatron_lm "$KIND")
    SPEC_MODULE=prefix_sharing.megatron_ext.megatron_lm_spec
    TRANSFORMER_IMPL=transformer_engine
fi
if [[ $KIND == sft ]]; then
    DATA=(--data-path "$DATA_PATH" --tokenizer-type SFTTokenizer)
else
    # one micro-batch is one pack of sequences that share prefixes, under a computed-token budget
    DATA=(--prefix-sharing-data "$TRAJECTORIES" --micro-batch-size 1
          --tokenizer-type HuggingFaceTokenizer)
fi

# node_command RANK: fills NODE_ENV and NODE_CMD for node RANK.
node_command() {
    NODE_ENV=()
    if [[ -n "$MEGATRON_LM" || -n "${PYTHONPATH:-}" ]]; then
        NODE_ENV+=("PYTHONPATH=$MEGATRON_LM${MEGATRON_LM:+${PYTHONPATH:+:}}${PYTHONPATH:-}")
    fi
    if [[ $DEVICE == ascend ]]; then
        ascend_env "$NPROC_PER_NODE"
    else
        cuda_env "$NPROC_PER_NODE"
    fi
    NODE_CMD=(
        torchrun --nnodes "${#NODES[@]}" --node-rank "$1" --nproc-per-node "$NPROC_PER_NODE"
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
        "${ENTRY[@]}"
        --spec "$SPEC_MODULE" layer_spec
        --transformer-impl "$TRANSFORMER_IMPL"
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        # what prefix sharing needs: RoPE applied per token (no fused THD rotary), no dropout
        --position-embedding-type rope --no-rope-fusion
        --attention-dropout 0 --hidden-dropout 0
        --bf16
        "${DATA[@]}" --tokenizer-model "$TOKENIZER_MODEL"
    )
    if [[ $DEVICE == ascend ]]; then
        NODE_CMD+=(--distributed-backend nccl)  # MindSpeed maps it to HCCL
    fi
    if [[ -n "$SAVE_DIR" ]]; then NODE_CMD+=(--save "$SAVE_DIR"); fi
    if [[ -n "$LOAD_DIR" ]]; then NODE_CMD+=(--load "$LOAD_DIR"); fi
    NODE_CMD+=("${EXTRA[@]}")
}

if ((DRY_RUN)); then
    for rank in "${!NODES[@]}"; do
        node_command "$rank"
        launch_node "node $rank (${NODES[$rank]}) of ${#NODES[@]}, $DEVICE, $NPROC_PER_NODE ranks"
    done
    exit 0
fi
NODE_RANK=${NODE_RANK:-$(this_node_rank)}
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || ((NODE_RANK >= ${#NODES[@]})); then
    die "--node-rank must be in 0..$((${#NODES[@]} - 1)), got '$NODE_RANK'"
fi
node_command "$NODE_RANK"
launch_node "node $NODE_RANK"
