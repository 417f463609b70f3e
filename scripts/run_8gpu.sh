#!/usr/bin/env bash
# DeepSeek-V3 671B on 8 GPUs of one host: benchmark the layouts, then chat with the chosen one.
#
#   CKPT=/path/to/DeepSeek-V3 scripts/run_8gpu.sh bench        # all layouts, 4 layers (fits any host)
#   CKPT=/path/to/DeepSeek-V3 LAYOUT=dp-attn scripts/run_8gpu.sh chat
#   CKPT=... LAYOUT=... scripts/run_8gpu.sh chat-processes     # one process per GPU (jax.distributed)
#
# Layouts (dsv3_jax/sharding.py PRESETS; per-GPU memory in benchmarks/memory-plan-671B-8xH200-layouts.md):
#   tp       attention TP over heads, routed experts EP, dense MLP / shared experts / vocab TP
#   dp-attn  attention and its cache split by batch rows; only the routed experts split
#   dp-attn-tp  attention as dp-attn, the rest split as tp
#   rep-attn attention replicated, the rest as tp
#   ep-only  only the routed experts split (one collective per MoE layer)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
LAYOUT=${LAYOUT:-tp}
LAYOUTS=${LAYOUTS:-tp,dp-attn,dp-attn-tp,rep-attn,ep-only}
GPUS=${GPUS:-8}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

case "${1:-bench}" in
  bench)
    # the full 671B config cut to 4 layers (3 dense + 1 MoE) with random fp8 weights; --layers 61 for all
    $PY scripts/bench_model.py --config configs/config_671B.json --layers "${LAYERS:-4}" --weights fp8 \
      --num-devices "$GPUS" --layouts "$LAYOUTS" --decode-batches 1,8,32 --prefill-batches 1,8 \
      --tag "${GPUS}gpu-layouts"
    $PY scripts/count_collectives.py --config configs/config_671B.json --num-devices "$GPUS" --batch 8 \
      --layouts "$LAYOUTS" --out "benchmarks/collectives-671B-${GPUS}gpu.json"
    ;;
  chat)
    : "${CKPT:?set CKPT to the checkpoint directory}"
    $PY -m dsv3_jax.chat --ckpt-path "$CKPT" --num-devices "$GPUS" --layout "$LAYOUT" --interactive \
      --max-seq-len "${MAX_SEQ_LEN:-4096}"
    ;;
  chat-processes)
    # one process per GPU, each seeing only its own GPU; process 0 reads stdin and prints
    : "${CKPT:?set CKPT to the checkpoint directory}"
    ADDRESS=${ADDRESS:-127.0.0.1:12355}
    for ((rank = 1; rank < GPUS; rank++)); do
      CUDA_VISIBLE_DEVICES=$rank $PY -m dsv3_jax.chat --ckpt-path "$CKPT" --layout "$LAYOUT" --interactive \
        --max-seq-len "${MAX_SEQ_LEN:-4096}" --coordinator-address "$ADDRESS" --num-processes "$GPUS" \
        --process-id "$rank" </dev/null >/dev/null &
    done
    CUDA_VISIBLE_DEVICES=0 $PY -m dsv3_jax.chat --ckpt-path "$CKPT" --layout "$LAYOUT" --interactive \
      --max-seq-len "${MAX_SEQ_LEN:-4096}" --coordinator-address "$ADDRESS" --num-processes "$GPUS" --process-id 0
    wait
    ;;
  *)
    echo "usage: $0 bench|chat|chat-processes" >&2
    exit 2
    ;;
esac
