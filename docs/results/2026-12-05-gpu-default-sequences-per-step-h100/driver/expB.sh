# Run B: the same command in another run folder that starts from run A's finished data (its data stage is then
# "up to date"), with the overrides in /tmp/exp/b.args.
set -x
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
RUN=/tmp/runs/B
rm -rf $RUN && mkdir -p $RUN && cp -r /tmp/runs/quick/data $RUN/
t0=$(date +%s)
python3 -m dflash.train +experiment=smollm2_quick run_dir=$RUN show_progress=false logging.wandb.mode=disabled \
  $(cat /tmp/exp/b.args) > /tmp/exp/recipeB.log 2>&1
echo "RECIPE B rc=$? wall_s=$(( $(date +%s) - t0 ))"
tail -n 30 /tmp/exp/recipeB.log
touch /tmp/exp/doneB
