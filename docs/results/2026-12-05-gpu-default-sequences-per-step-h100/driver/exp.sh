# Session 29, run A: the GPU default (smollm2_quick) at 128 sequences x 32 anchors a step (the same anchor slots as
# 64 x 64, twice the sequences; issue 23 point 1). Run B (.gpu/expB.sh) reuses this run's data.
set -x
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
RUN=/tmp/runs/quick
t0=$(date +%s)
python3 -m dflash.train +experiment=smollm2_quick run_dir=$RUN show_progress=false logging.wandb.mode=disabled \
  train.micro_batch_size=128 train.num_anchors=32 > /tmp/exp/recipe.log 2>&1
echo "RECIPE rc=$? wall_s=$(( $(date +%s) - t0 ))"
tail -n 30 /tmp/exp/recipe.log
touch /tmp/exp/done
