#!/usr/bin/env bash
# Serve a DeepSeek-V4.1 checkpoint on every GPU of this node: one worker process per GPU, attention
# data-parallel, experts sharded over the GPUs (expert parallelism through NCCL all-to-all).
#
#   deploy/launch_node.sh /path/to/checkpoint [extra `mini-deepinfer serve` flags...]
#
# Environment: HOST (default 0.0.0.0), PORT (8000), NUM_GPUS (default: all visible GPUs),
# API_KEY (optional bearer token). Across several nodes: deploy/launch_head.sh on node 0 and
# deploy/launch_worker_node.sh on every other node (README, Multi-node).
set -euo pipefail
model=${1:?usage: deploy/launch_node.sh CHECKPOINT_DIR [serve flags...]}; shift
gpus=${NUM_GPUS:-$(nvidia-smi -L | wc -l)}
# NVLink multicast stays off: the engine does not use it, and some shared hosts forbid it.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
args=(serve --model "$model" --device cuda --dp "$gpus" --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}")
[ -n "${API_KEY:-}" ] && args+=(--api-key "$API_KEY")
exec "${MINI_DEEPINFER:-mini-deepinfer}" "${args[@]}" "$@"
