#!/usr/bin/env bash
# A job that outlives the call that starts it, on a machine reached only by calls of a few minutes each, which keeps
# /tmp while the calls follow one another (the GPU machine of docs/results.md, "Commands"): one call starts the job
# in its own session, and the next calls wait for it and bring its files back in $OUT.
#
#   bash launch/detached_job.sh start NAME COMMAND...   # copy the repository to $JOBS/NAME/repo (so that the next
#                                                      # call's copy cannot change the job's code) and run COMMAND
#                                                      # there, first on PYTHONPATH; output in $JOBS/NAME/log
#   bash launch/detached_job.sh wait NAME SECONDS [RUN_DIR]   # wait up to SECONDS for the job to end, print its
#                                                      # log's tail and how it ended, then `collect`
#   bash launch/detached_job.sh collect NAME [RUN_DIR]  # the job's log, and RUN_DIR's small files (no weights,
#                                                      # features or data), into $OUT/NAME; with COLLECT_EXPORT=1 also
#                                                      # RUN_DIR/export_best in parts of PART_BYTES (15 MB), joined
#                                                      # again with `cat export_best.tar.part* | tar -xf -`
#
# $JOBS (default /tmp/dflash-jobs) holds one folder per job name; a name runs once per machine. The job's end is
# the line "rc=<exit status> wall_s=<seconds>" in $JOBS/NAME/exit, written when COMMAND returns.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-/tmp/dflash-jobs}
PART_BYTES=${PART_BYTES:-15000000}
TAIL=${TAIL:-40}

usage() {
  echo "usage: $0 start NAME COMMAND... | wait NAME SECONDS [RUN_DIR] | collect NAME [RUN_DIR]" >&2
  exit 2
}

start() {
  local name=$1 dir
  shift
  [ $# -gt 0 ] || usage
  dir="$JOBS/$name"
  if [ -e "$dir" ]; then
    echo "a job named $name has already run on this machine ($dir): give the new one another name" >&2
    exit 1
  fi
  mkdir -p "$dir/repo"
  # Not the carried transfers (asset parts, wheels) nor anything a run or an environment left in the copy.
  tar --exclude=./.stage --exclude='./.whl*' --exclude=./.venv --exclude=./.git --exclude=./runs --exclude=./outputs \
    --exclude=./wandb -cf - . | tar -xf - -C "$dir/repo"
  # setsid: the job is no child of this call's process group, which ends with the call; and it holds none of the
  # call's output streams, so the call returns at once.
  (
    cd "$dir/repo"
    setsid nohup bash -c \
      't0=$(date +%s); export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; "$@"; rc=$?; echo "rc=$rc wall_s=$(( $(date +%s) - t0 ))" > ../exit.tmp; mv ../exit.tmp ../exit' \
      job "$@" > "$dir/log" 2>&1 < /dev/null &
  )
  echo "started $name in $dir (log: $dir/log)"
}

wait_for() {
  local name=$1 limit=$2 run_dir=${3:-} dir deadline
  dir="$JOBS/$name"
  [ -d "$dir" ] || { echo "no job named $name was started on this machine (in $JOBS)" >&2; exit 1; }
  deadline=$((SECONDS + limit))
  while [ ! -f "$dir/exit" ] && [ $SECONDS -lt "$deadline" ]; do
    sleep 1
  done
  tail -n "$TAIL" "$dir/log"
  if [ -f "$dir/exit" ]; then
    echo "$name ended: $(cat "$dir/exit")"
  else
    echo "$name still running after ${limit} s of waiting"
  fi
  collect "$name" "$run_dir"
}

collect() {
  local name=$1 run_dir=${2:-} dir into
  dir="$JOBS/$name"
  [ -n "${OUT:-}" ] || { echo "collect writes into \$OUT, which is not set" >&2; exit 1; }
  into="$OUT/$name"
  mkdir -p "$into"
  cp "$dir/log" "$into/log"
  [ -f "$dir/exit" ] && cp "$dir/exit" "$into/exit"
  if [ -n "$run_dir" ] && [ -d "$run_dir" ]; then
    tar -C "$(dirname "$run_dir")" -czf "$into/run.tar.gz" --exclude=checkpoints --exclude='export*' \
      --exclude=feature_cache --exclude='*.arrow' --exclude=journal.jsonl --exclude='*.safetensors' --exclude='*.pt' \
      --exclude=dataset --exclude=synthetic.jsonl "$(basename "$run_dir")"
    if [ "${COLLECT_EXPORT:-0}" = 1 ] && [ -d "$run_dir/export_best" ]; then
      tar -C "$run_dir" -cf - export_best | split -b "$PART_BYTES" -d -a 2 - "$into/export_best.tar.part"
    fi
  fi
  ls -la "$into"
}

case "${1:-}" in
  start) [ $# -ge 3 ] || usage; shift; start "$@" ;;
  wait) [ $# -ge 3 ] || usage; wait_for "$2" "$3" "${4:-}" ;;
  collect) [ $# -ge 2 ] || usage; collect "$2" "${3:-}" ;;
  *) usage ;;
esac
