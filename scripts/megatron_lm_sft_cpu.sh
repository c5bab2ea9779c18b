#!/usr/bin/env bash
# Megatron-LM's SFT training loop with prefix sharing on the CPU (gloo, one rank): generated
# conversations that share system prompts and histories, a small GPT, N iterations, with
# --prefix-sharing-mode MODE (arbitrary_prefix or off). Megatron-LM logs per iteration:
# "elapsed time per iteration", "lm loss", "tokens total", "tokens computed", "token ratio".
#
#   scripts/megatron_lm_sft_cpu.sh arbitrary_prefix 12 > shared.log
#   scripts/megatron_lm_sft_cpu.sh off 12 > off.log
#
# Needs megatron-core >= 0.17 (Python 3.12), transformers and tokenizers; run from the repo root.
set -euo pipefail
MODE=${1:-arbitrary_prefix}
ITERS=${2:-12}
PYTHON=${PYTHON:-python3}
DATA=${DATA:-/tmp/prefix_sharing_sft_example}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" -m tests.megatron_lm._data "$DATA" 64 >/dev/null
exec "$PYTHON" -m torch.distributed.run --nproc-per-node 1 --master-port "${MASTER_PORT:-29533}" \
    -m prefix_sharing.megatron_lm sft \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention \
    --num-query-groups 4 --ffn-hidden-size 768 --max-position-embeddings 1024 \
    --transformer-impl local --normalization RMSNorm --swiglu --disable-bias-linear \
    --position-embedding-type rope --untie-embeddings-and-output-weights \
    --attention-dropout 0 --hidden-dropout 0 --no-gradient-accumulation-fusion \
    --use-cpu-initialization --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion \
    --no-persist-layer-norm --distributed-backend gloo \
    --tokenizer-type SFTTokenizer --tokenizer-model "$DATA/tok" \
    --sft-tokenizer-prompt-format nemotron-h-aligned --data-path "$DATA/convs.jsonl" \
    --seq-length 256 --micro-batch-size 4 --global-batch-size 8 --train-iters "$ITERS" \
    --lr 1e-4 --min-lr 1e-4 --lr-decay-style constant --log-interval 1 --eval-iters 0 \
    --eval-interval 100000 --seed 1234 --prefix-sharing-mode "$MODE"
