#!/usr/bin/env bash
# Several nodes through the deepspeed launcher (pdsh/ssh from this node), run_dir on a shared filesystem; data +
# capture must have run already. The launcher passes --local_rank=N, which python -m dflash.train accepts.
# Usage: launch/deepspeed_hostfile.sh HOSTFILE MASTER_ADDR [hydra overrides...]
#   HOSTFILE lines: "node-a slots=8" (see launch/hostfile.example)
set -euo pipefail
hostfile=$1 master=$2; shift 2
deepspeed --hostfile "$hostfile" --master_addr "$master" --master_port "${MASTER_PORT:-29500}" \
  --module dflash.train "$@" 'stages=[train]'
