#!/usr/bin/env bash
# Node 0 of a multi-node deployment: the frontend (HTTP API), the engine core and this node's GPUs
# as ranks 0 .. GPUS_PER_NODE-1. Start deploy/launch_worker_node.sh on every other node (before or
# after this one); /health answers 200 once every rank of every node has joined and loaded.
#
#   NNODES=2 MASTER_ADDR=10.0.0.1 deploy/launch_head.sh /path/to/checkpoint [extra `serve` flags...]
#
# Environment: NNODES (required), MASTER_ADDR (required: this node's address as the others reach
# it), MASTER_PORT (29500; it and the next two ports must be open to the other nodes),
# GPUS_PER_NODE (default: all visible GPUs), CLUSTER_KEY_FILE (default ~/.mini-deepinfer/cluster.key,
# made here if missing: copy it to the same path on every node), HOST (0.0.0.0), PORT (8000),
# API_KEY (optional bearer token). Every node must get the same model and engine flags.
set -euo pipefail
model=${1:?usage: deploy/launch_head.sh CHECKPOINT_DIR [serve flags...]}; shift
nnodes=${NNODES:?set NNODES, the number of nodes}
master_addr=${MASTER_ADDR:?set MASTER_ADDR, the address of this node as the other nodes reach it}
gpus=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
key=${CLUSTER_KEY_FILE:-$HOME/.mini-deepinfer/cluster.key}
if [ ! -e "$key" ]; then
  mkdir -p "$(dirname "$key")"
  (umask 077 && openssl rand -hex 32 > "$key")
  echo "made the cluster key $key: copy it to the same path on every other node (scp, mode 600)" >&2
fi
# NVLink multicast stays off: the engine does not use it, and some shared hosts forbid it.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
args=(serve --model "$model" --device cuda --dp $((gpus * nnodes)) --nnodes "$nnodes" --node-rank 0
      --master-addr "$master_addr" --master-port "${MASTER_PORT:-29500}" --cluster-key-file "$key"
      --host "${HOST:-0.0.0.0}" --port "${PORT:-8000}")
[ -n "${API_KEY:-}" ] && args+=(--api-key "$API_KEY")
exec "${MINI_DEEPINFER:-mini-deepinfer}" "${args[@]}" "$@"
