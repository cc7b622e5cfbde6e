#!/usr/bin/env bash
# Several nodes through the deepspeed launcher (pdsh/ssh from this node), run_dir on a shared filesystem; data +
# capture must have run already. The launcher passes --local_rank=N, which python -m dflash.train accepts.
# Usage: launch/deepspeed_hostfile.sh HOSTFILE MASTER_ADDR [hydra overrides...]
#   HOSTFILE lines: "node-a slots=8" (see launch/hostfile.example)
# DRY_RUN=1 prints the command without running it.
source "$(dirname "$0")/usage.sh"
usage_or_help 2 "HOSTFILE MASTER_ADDR [hydra overrides...]" "$@"
set -euo pipefail
hostfile=$1 master=$2; shift 2
if [ ! -f "$hostfile" ]; then  # deepspeed would go on without one, training on this node alone
  echo "deepspeed_hostfile.sh: HOSTFILE $hostfile is not a file (deepspeed would train on this node alone): give" \
    "one of lines like \"node-a slots=8\" (launch/hostfile.example)" >&2
  exit 2
fi
command=(deepspeed --hostfile "$hostfile" --master_addr "$master" --master_port "${MASTER_PORT:-29500}"
  --module dflash.train "$@" 'stages=[train]')
show_command "${command[@]}"
if [ "${DRY_RUN:-0}" != 1 ]; then "${command[@]}"; fi
