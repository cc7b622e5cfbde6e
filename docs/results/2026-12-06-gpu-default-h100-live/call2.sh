# Call 2 (the last part: .stage/part-3 since session 41): the rest; every CUDA test killed at $2 s; then a job
# detached, waited for up to $1 s. The job is `$3 $4 COMMAND...` (name, run folder, command) when given, else the
# README's first command (the GPU default), as this session ran it: `bash call2.sh 440 0`.
eval "$(bash launch/stage_assets.sh receive)"
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${2:-100}" -gt 0 ]; then
  timeout -s KILL ${2:-100} python3 -m pytest -q -p no:cacheprovider -W ignore -rfs --tb=short -m gpu tests \
    > $OUT/gputests.log 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gputests.log | cut -c1-300 | tail -20
fi
wait_s=${1:-440}
if [ $# -ge 5 ]; then
  name=$3 run_dir=$4
  shift 4
else
  name=quick run_dir=/tmp/runs/quick
  set -- python3 -m dflash.train run_dir=$run_dir show_progress=false logging.wandb.mode=disabled
fi
bash launch/detached_job.sh start "$name" "$@"
bash launch/detached_job.sh wait "$name" "$wait_s" "$run_dir"
