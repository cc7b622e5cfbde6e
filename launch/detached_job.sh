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
#                                                      # again with `cat export_best.tar.part* | tar -xf -` in the
#                                                      # unpacked run folder (run.tar.gz), which an evaluation then
#                                                      # measures
#
# $JOBS (default /tmp/dflash-jobs) holds one folder per job name; a name runs once per machine. The job's end is
# the line "rc=<exit status> wall_s=<seconds>" in $JOBS/NAME/exit, written when COMMAND returns; a job killed before
# it (its process gone, $JOBS/NAME/pid) is reported as such. A relative RUN_DIR is the job's, in its copy.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-/tmp/dflash-jobs}
PART_BYTES=${PART_BYTES:-15000000}
TAIL=${TAIL:-40}

usage() {
  echo "usage: $0 start NAME COMMAND... | wait NAME SECONDS [RUN_DIR] | collect NAME [RUN_DIR]" >&2
  exit 2
}

# What the job runs around COMMAND: the copy first on the path, then COMMAND, then its end in ../exit (written whole:
# a reader never sees half a line).
RUNNER='t0=$(date +%s); export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; "$@"; rc=$?
echo "rc=$rc wall_s=$(( $(date +%s) - t0 ))" > ../exit.tmp && mv ../exit.tmp ../exit'

check_name() {
  case "$1" in
    ''|*/*|.|..) echo "a job name is one plain word (got '$1')" >&2; exit 2 ;;
  esac
}

start() {
  local name=$1 dir
  shift
  [ $# -gt 0 ] || usage
  check_name "$name"
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
    setsid nohup bash -c "$RUNNER" job "$@" > "$dir/log" 2>&1 < /dev/null &
    echo $! > "$dir/pid"
  )
  echo "started $name in $dir (log: $dir/log)"
}

job_dir() {
  check_name "$1"
  [ -d "$JOBS/$1" ] || { echo "no job named $1 was started on this machine (in $JOBS)" >&2; exit 1; }
  echo "$JOBS/$1"
}

alive() {
  [ -f "$1/pid" ] && kill -0 "$(cat "$1/pid")" 2> /dev/null
}

wait_for() {
  local name=$1 limit=$2 run_dir=${3:-} dir deadline
  dir=$(job_dir "$name")
  deadline=$((SECONDS + limit))
  while [ ! -f "$dir/exit" ] && alive "$dir" && [ $SECONDS -lt "$deadline" ]; do
    sleep 1
  done
  tail -n "$TAIL" "$dir/log"
  if [ -f "$dir/exit" ]; then
    echo "$name ended: $(cat "$dir/exit")"
  elif ! alive "$dir"; then
    echo "$name ended without an exit record: killed (out of memory, a signal to its process group?)"
  else
    echo "$name still running after ${limit} s of waiting"
  fi
  collect "$name" "$run_dir"
}

collect() {
  local name=$1 run_dir=${2:-} dir into status
  dir=$(job_dir "$name")
  [ -n "${OUT:-}" ] || { echo "collect writes into \$OUT, which is not set" >&2; exit 1; }
  into="$OUT/$name"
  mkdir -p "$into"
  cp "$dir/log" "$into/log"
  if [ -f "$dir/exit" ]; then cp "$dir/exit" "$into/exit"; fi
  case "$run_dir" in
    ''|/*) ;;
    *) run_dir="$dir/repo/$run_dir" ;;  # relative to where the job runs, its own copy
  esac
  if [ -n "$run_dir" ] && [ ! -d "$run_dir" ]; then
    echo "no run folder $run_dir to collect" >&2
  elif [ -n "$run_dir" ]; then
    # A job still running writes on while tar reads (metrics, logs): tar says so with status 1, and the copy holds
    # what was there, which is what a collect in the middle of a run is for.
    status=0
    tar -C "$(dirname "$run_dir")" -czf "$into/run.tar.gz" --warning=no-file-changed --warning=no-file-removed \
      --ignore-failed-read --exclude=checkpoints \
      --exclude='export*' --exclude=feature_cache --exclude='*.arrow' --exclude=journal.jsonl \
      --exclude='*.safetensors' --exclude='*.pt' --exclude=dataset --exclude=synthetic.jsonl \
      "$(basename "$run_dir")" || status=$?
    [ "$status" -le 1 ] || exit "$status"
    if [ "${COLLECT_EXPORT:-0}" = 1 ] && [ -d "$run_dir/export_best" ]; then
      # With the records that make the folder a drafter of its settings to `python -m dflash.eval` once unpacked
      # into the run folder: export/done.json (the stage's mark: without it no drafter of these settings is found)
      # and the training command the evaluation adopts (checkpoints/settings.json).
      tar -C "$run_dir" -cf - export_best $(cd "$run_dir" && ls export/done.json checkpoints/settings.json 2>/dev/null) \
        | split -b "$PART_BYTES" -d -a 2 - "$into/export_best.tar.part"
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
