#!/usr/bin/env bash
# Several nodes, one call per node, run_dir on a shared filesystem; data + capture must have run already
# (launch/one_node.sh ... 'stages=[data,capture]' on one node).
# Usage: launch/multi_node.sh NNODES NODE_RANK MASTER_ADDR [hydra overrides...]
set -euo pipefail
nnodes=$1 node_rank=$2 master=$3; shift 3
torchrun --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "${GPUS_PER_NODE:-8}" \
  --master_addr "$master" --master_port "${MASTER_PORT:-29500}" -m dflash.train "$@" 'stages=[train]'
