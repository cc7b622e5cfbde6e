# Run A: the README's first command on a fresh machine (the GPU default, smollm2_quick at 32 x 64, with
# session 30's lighter ZeRO-2 host work), timed from the command to eval/summary.json (issue 23 point 1).
set -x
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
RUN=/tmp/runs/quick
t0=$(date +%s)
python3 -m dflash.train run_dir=$RUN show_progress=false logging.wandb.mode=disabled > /tmp/exp/recipe.log 2>&1
echo "RECIPE rc=$? wall_s=$(( $(date +%s) - t0 ))"
tail -n 30 /tmp/exp/recipe.log
touch /tmp/exp/done
