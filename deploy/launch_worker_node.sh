#!/usr/bin/env bash
# Node R > 0 of a multi-node deployment: this node's GPUs as ranks R*GPUS_PER_NODE and up, with no
# frontend and no engine core (`serve --headless`). They reach the engine core that
# deploy/launch_head.sh runs on node 0; start order does not matter. The node exits when the
# engine core shuts down (0) or goes away (1); when one of its workers dies it tells the engine
# core, which ends every request with an error and exits, and the node exits 1.
#
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 deploy/launch_worker_node.sh /path/to/checkpoint [flags...]
#
# Environment: NNODES, NODE_RANK, MASTER_ADDR (node 0's address; all required), MASTER_PORT (29500),
# GPUS_PER_NODE (default: all visible GPUs; the same on every node), CLUSTER_KEY_FILE (default
# ~/.mini-deepinfer/cluster.key: a copy of node 0's). Give the same model and engine flags as node 0.
set -euo pipefail
model=${1:?usage: deploy/launch_worker_node.sh CHECKPOINT_DIR [serve flags...]}; shift
nnodes=${NNODES:?set NNODES, the number of nodes}
node_rank=${NODE_RANK:?set NODE_RANK, the index of this node (1 .. NNODES-1)}
master_addr=${MASTER_ADDR:?set MASTER_ADDR, the address of node 0}
gpus=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
key=${CLUSTER_KEY_FILE:-$HOME/.mini-deepinfer/cluster.key}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec "${MINI_DEEPINFER:-mini-deepinfer}" serve --headless --model "$model" --device cuda --dp $((gpus * nnodes)) \
  --nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr" --master-port "${MASTER_PORT:-29500}" \
  --cluster-key-file "$key" "$@"
