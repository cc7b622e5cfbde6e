#!/usr/bin/env bash
# Several nodes, one call per node, run_dir on a shared filesystem; data + capture must have run already
# (CAPTURE_ONLY=1 launch/one_node.sh ... on one node). Every node has GPUS_PER_NODE (8) GPUs, one trainer
# rank each, except with capture=online (dflash/extract/rank_link.py), where some ranks capture and torchrun also
# restarts the job MAX_RESTARTS (3) times after a rank dies (a user error or divergence ends it: the run id below):
#   capture.ranks=C             the job's last C ranks capture, one GPU each: every node runs GPUS_PER_NODE ranks,
#                               the last node(s)' GPUs capturing (capture.gpus_per_worker > 1: one node only)
#   capture.ranks_per_node=k    every node's last k ranks capture on capture.gpus_per_worker = g GPUs each:
#                               GPUS_PER_NODE - k*g trainer ranks (GPUs 0 ..), then k capture ranks (the last GPUs)
# Usage: launch/multi_node.sh NNODES NODE_RANK MASTER_ADDR [hydra overrides...]
#   e.g. launch/multi_node.sh 2 R HOST +experiment=qwen36 capture=online capture.ranks_per_node=2 \
#        run_dir=/shared/runs/qwen36                                    # node R of 2: 6 trainers + 2 capture ranks
# The rendezvous is at MASTER_ADDR:MASTER_PORT (29500): torchrun's c10d one (RDZV_BACKEND=c10d, launch/slurm.sbatch) or
# a static one (RDZV_BACKEND=static). capture=online on several nodes takes c10d unless told otherwise: its restarts
# need every node's agent to restart together, which only the c10d rendezvous tells the healthy nodes to do (with a
# static one it runs without restarts).
# DRY_RUN=1 prints the command without running it.
source "$(dirname "$0")/usage.sh"
usage_or_help 3 "NNODES NODE_RANK MASTER_ADDR [hydra overrides...]" "$@"
set -euo pipefail
nnodes=$1 node_rank=$2 master=$3; shift 3
settings=$(python "$(dirname "$0")/launch_settings.py" "$@")  # the composed config's settings as shell assignments
eval "$settings"
gpus=${GPUS_PER_NODE:-8}
nproc=$gpus restarts=() backend=${RDZV_BACKEND:-static}
if [ "$capture_mode" = online ]; then
  restarts=(--max-restarts "${MAX_RESTARTS:-3}")
  if [ "$nnodes" != 1 ]; then backend=${RDZV_BACKEND:-c10d}; fi
  if [ -n "$ranks_per_node" ]; then
    if [ $((ranks_per_node * gpus_per_worker)) -ge "$gpus" ]; then  # the job would fail at every (re)start
      echo "multi_node.sh: capture.ranks_per_node=$ranks_per_node capture ranks of $gpus_per_worker GPU(s) take" \
        "$((ranks_per_node * gpus_per_worker)) of a node's GPUS_PER_NODE=$gpus GPUs, leaving no trainer rank:" \
        "capture on fewer GPUs a node, or set GPUS_PER_NODE to the node's GPUs" >&2
      exit 2
    fi
    nproc=$((gpus - ranks_per_node * gpus_per_worker + ranks_per_node))
  elif [ "$gpus_per_worker" != 1 ] && [ "$nnodes" != 1 ]; then
    echo "multi_node.sh: capture.gpus_per_worker=$gpus_per_worker with the job's last capture.ranks ranks capturing" \
      "runs on one node only: set capture.ranks_per_node (every node's last ranks capture) or give each capture" \
      "rank one GPU" >&2
    exit 2
  fi
fi
run() {  # print a command, then run it unless DRY_RUN=1
  show_command "$@"
  if [ "${DRY_RUN:-0}" != 1 ]; then "$@"; fi
}
if [ "$capture_mode" = online ] && [ "$nnodes" != 1 ]; then
  if [ "$backend" = c10d ]; then
    # A store per start: torchrun counts restarts per node, so one store kept for every start cannot tell the nodes'
    # ranks which start's keys are theirs (dflash/extract/rank_link.py, start_prefix).
    run export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  else
    restarts=()  # a static rendezvous never restarts the healthy nodes: a restart could not meet them
  fi
fi
rendezvous=(--master_addr "$master" --master_port "${MASTER_PORT:-29500}")
if [ "$backend" = c10d ]; then
  rendezvous=(--rdzv_backend c10d --rdzv_endpoint "$master:${MASTER_PORT:-29500}")
fi
if [ "${#restarts[@]}" != 0 ]; then
  # The job's run id (TORCHELASTIC_RUN_ID), one per launch and the same on every node: a restarted start stops at once
  # after an error that an earlier start of this job recorded and a restart would meet again (a user error,
  # divergence: dflash/pipeline.py). RDZV_ID, else SLURM's job id and requeue count, else on one node a new one.
  job_id=${RDZV_ID:-${SLURM_JOB_ID:+slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}}}
  if [ -z "$job_id" ] && [ "$nnodes" = 1 ]; then job_id=$(python -c 'import uuid; print(uuid.uuid4())'); fi
  if [ -n "$job_id" ]; then rendezvous+=(--rdzv_id "$job_id"); fi
fi
run torchrun --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$nproc" "${restarts[@]}" \
  "${rendezvous[@]}" -m dflash.train "$@" 'stages=[train]'
