# Session 19: the GPU default exactly as the README's first command runs it (issue 23), then the replay estimate at
# T=1 with sampled drafts over draft temperatures and live T=1 at 1.0 and the best of them (issue 18).
set -x
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
RUN=/tmp/runs/quick
t0=$(date +%s)
python3 -m dflash.train run_dir=$RUN show_progress=false logging.wandb.mode=disabled > /tmp/exp/recipe.log 2>&1
echo "RECIPE rc=$? wall_s=$(( $(date +%s) - t0 ))"
tail -n 30 /tmp/exp/recipe.log
SETS="eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
EV="python3 -m dflash.eval +experiment=smollm2_quick run_dir=$RUN show_progress=false logging.wandb.mode=disabled"
for dt in 1.0 1.4 0.7 2.0 0.5; do
  t1=$(date +%s)
  $EV eval.temperature=1.0 eval.draft_sampling=sampled eval.draft_temperature=$dt eval.out_dir=$RUN/est_t1_dt$dt $SETS \
    > /tmp/exp/est_$dt.log 2>&1
  echo "EST dt=$dt rc=$? s=$(( $(date +%s) - t1 ))"; tail -n 12 /tmp/exp/est_$dt.log
done
best=$(python3 -c "
import json
r = {dt: json.load(open('$RUN/est_t1_dt%s/summary.json' % dt))['overall']['tau'] for dt in ['1.0','1.4','0.7','2.0','0.5']}
print(max(r, key=r.get))")
echo "BEST dt=$best"
for dt in 1.0 $best; do
  [ -f $RUN/live_t1_dt$dt/summary.json ] && continue
  t1=$(date +%s)
  $EV eval.mode=live eval.temperature=1.0 eval.draft_sampling=sampled eval.draft_temperature=$dt \
    eval.out_dir=$RUN/live_t1_dt$dt $SETS > /tmp/exp/live_$dt.log 2>&1
  echo "LIVE dt=$dt rc=$? s=$(( $(date +%s) - t1 ))"; tail -n 14 /tmp/exp/live_$dt.log
done
touch /tmp/exp/done
