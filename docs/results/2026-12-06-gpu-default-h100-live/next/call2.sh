# Call 2 of the full recipe's plan (.whl-b, .stage/part-2): the rest of the wheels and assets; every CUDA test killed
# at $2 s (0: none); then issue 18's full recipe at 32 sequences a step, detached, waited for up to $1 s.
eval "$(bash launch/stage_assets.sh receive)"
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${2:-100}" -gt 0 ]; then
  timeout -s KILL ${2:-100} python3 -m pytest -q -p no:cacheprovider -W ignore -rfs --tb=short -m gpu tests \
    > $OUT/gputests.log 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gputests.log | cut -c1-300 | tail -20
fi
bash launch/detached_job.sh start full python3 -m dflash.train +experiment=smollm2 train.micro_batch_size=32 \
  run_dir=/tmp/runs/full show_progress=false logging.wandb.mode=disabled
bash launch/detached_job.sh wait full ${1:-420} /tmp/runs/full
