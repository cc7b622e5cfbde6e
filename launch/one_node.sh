#!/usr/bin/env bash
# One node: data on the first capture worker's GPUs, capture on capture.devices (offline: one torchrun process per
# capture worker, each capturing its share of the shards), the DeepSpeed trainer on train.devices, then eval.
# A worker has capture.gpus_per_worker = g GPUs (the target placed layer-wise over them): offline capture runs
# len(capture.devices)/g processes that all see every capture GPU, and local rank r takes GPUs r*g .. r*g+g-1.
# Unlisted, capture.devices is one worker's GPUs from 0 (with capture.ranks_per_node=k, k workers'); train.devices [0].
# capture=online: the train stage is one torchrun job of the trainer GPUs, one rank each, and then one capture rank
# per capture worker of g GPUs (dflash/extract/rank_link.py); MAX_RESTARTS (default 3) restarts of the job after a
# rank dies (a user error or divergence ends it at its first start: dflash/pipeline.py, refuse_after_earlier_ending).
# Usage: launch/one_node.sh [hydra overrides...]   e.g. launch/one_node.sh +experiment=qwen36 target.path=/models/x
# DRY_RUN=1 prints the commands without running them; CAPTURE_ONLY=1 ends after the data and capture steps (a capture
# node: launch/slurm_capture.sbatch).
source "$(dirname "$0")/usage.sh"
usage_or_help 0 "[hydra overrides...]" "$@"
set -euo pipefail
# The composed config's settings as shell assignments.
settings=$(python "$(dirname "$0")/launch_settings.py" "$@")
eval "$settings"
run() {  # print a command, then run it unless DRY_RUN=1
  show_command "$@"
  if [ "${DRY_RUN:-0}" != 1 ]; then "$@"; fi
}
ncapture=$(awk -F, '{print NF}' <<<"$capture_devices")
nworkers=$((ncapture / gpus_per_worker))
first_worker=$(cut -d, -f1-"$gpus_per_worker" <<<"$capture_devices")  # the GPUs of capture worker 0
ntrain=$(awk -F, '{print NF}' <<<"$train_devices")
capture_only=${CAPTURE_ONLY:-0}
if [ "$capture_only" != 1 ] && [ -n "$shared_gpus_problem" ]; then  # the online job this node would run
  echo "dflash: error: $shared_gpus_problem" >&2
  exit 2
fi
if [ "$capture_only" != 1 ] && [ "$capture_mode" = online ] && [ -n "$ranks_per_node" ] \
    && [ "$ranks_per_node" != "$nworkers" ]; then
  echo "one_node.sh: capture.ranks_per_node=$ranks_per_node, but capture.devices=[$capture_devices] makes" \
    "$nworkers capture rank(s) of $gpus_per_worker GPU(s) on this node: list them in capture.devices" >&2
  exit 2
fi
run env CUDA_VISIBLE_DEVICES="$first_worker" python -m dflash.train "$@" 'stages=[data]'
if [ "$capture_mode" = offline ]; then
  run env CUDA_VISIBLE_DEVICES="$capture_devices" torchrun --standalone --nproc_per_node "$nworkers" \
    -m dflash.train "$@" 'stages=[capture]'
else  # online / colocated: the capture stage only prepares what the train stage's capture needs
  run env CUDA_VISIBLE_DEVICES="$first_worker" python -m dflash.train "$@" 'stages=[capture]'
fi
if [ "$capture_only" = 1 ]; then
  exit 0
fi
if [ "$capture_mode" = online ]; then
  # One job: trainer ranks 0..ntrain-1 on train.devices (one GPU each), then one capture rank per capture worker of
  # gpus_per_worker consecutive capture GPUs (rank_link.rank_devices); a rank that dies ends the job, torchrun
  # restarts it and training resumes exactly.
  run env CUDA_VISIBLE_DEVICES="$train_devices,$capture_devices" torchrun --standalone \
    --nproc_per_node "$((ntrain + nworkers))" --max-restarts "${MAX_RESTARTS:-3}" \
    -m dflash.train "$@" "capture.ranks=$nworkers" "capture.gpus_per_worker=$gpus_per_worker" 'stages=[train]'
else
  run env CUDA_VISIBLE_DEVICES="$train_devices" torchrun --standalone --nproc_per_node "$ntrain" \
    -m dflash.train "$@" 'stages=[train]'
fi
run env CUDA_VISIBLE_DEVICES="$first_worker" python -m dflash.train "$@" 'stages=[eval]'
