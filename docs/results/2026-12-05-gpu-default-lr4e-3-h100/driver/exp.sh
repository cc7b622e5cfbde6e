# Session 25: the GPU default (smollm2_quick) with train.lr=4e-3 and data.decode_attention=flex (issue 23 point 1).
set -x
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
RUN=/tmp/runs/quick
t0=$(date +%s)
python3 -m dflash.train +experiment=smollm2_quick run_dir=$RUN show_progress=false logging.wandb.mode=disabled \
  train.lr=4e-3 data.decode_attention=flex > /tmp/exp/recipe.log 2>&1
echo "RECIPE rc=$? wall_s=$(( $(date +%s) - t0 ))"
tail -n 30 /tmp/exp/recipe.log
touch /tmp/exp/done
