# Call 3: the GPU default's end (up to $1 s), then live decoding at T=0 and T=1 (16 prompts a set) of its drafter,
# detached, waited for up to $2 s; the export comes back in parts.
eval "$(bash launch/stage_assets.sh receive)"
bash launch/detached_job.sh wait quick ${1:-200} /tmp/runs/quick > /tmp/quick_wait.log 2>&1
tail -25 /tmp/quick_wait.log
if [ ! -f /tmp/dflash-jobs/live/exit ] && [ ! -d /tmp/dflash-jobs/live ] && [ -f /tmp/runs/quick/eval/summary.json ]; then
  bash launch/detached_job.sh start live bash -c 'for t in 0.0 1.0; do python3 -m dflash.eval run_dir=/tmp/runs/quick \
    eval.mode=live eval.temperature=$t eval.out_dir=/tmp/runs/quick/eval_live_t$t eval.prompt_sets.humaneval.limit=16 \
    eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16 show_progress=false logging.wandb.mode=disabled \
    || exit 1; done'
fi
if [ -d /tmp/dflash-jobs/live ]; then
  COLLECT_EXPORT=1 bash launch/detached_job.sh wait live ${2:-330} /tmp/runs/quick
else
  COLLECT_EXPORT=1 bash launch/detached_job.sh collect quick /tmp/runs/quick
fi
