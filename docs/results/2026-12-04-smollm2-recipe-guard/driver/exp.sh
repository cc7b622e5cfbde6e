# Session 20: the SmolLM2 recipe exactly as documented (issue 19's guard: tau within 0.1 of session 9 per set), then
# (issue 18) the replay estimate at T=1 with sampled drafts on the recipe's drafter at draft temperatures 1.0 and 0.8.
set -x
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
RUN=/tmp/runs/smollm2
t0=$(date +%s)
python3 -m dflash.train +experiment=smollm2 run_dir=$RUN show_progress=false logging.wandb.mode=disabled > /tmp/exp/recipe.log 2>&1
echo "RECIPE rc=$? wall_s=$(( $(date +%s) - t0 ))"
tail -n 30 /tmp/exp/recipe.log
touch /tmp/exp/recipe_done
SETS="eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
EV="python3 -m dflash.eval +experiment=smollm2 run_dir=$RUN show_progress=false logging.wandb.mode=disabled"
for dt in 1.0 0.8; do
  t1=$(date +%s)
  $EV eval.temperature=1.0 eval.draft_sampling=sampled eval.draft_temperature=$dt eval.out_dir=$RUN/est_t1_dt$dt $SETS \
    > /tmp/exp/est_$dt.log 2>&1
  echo "EST dt=$dt rc=$? s=$(( $(date +%s) - t1 ))"; tail -n 12 /tmp/exp/est_$dt.log
done
touch /tmp/exp/done
