# The job of session 46's plan (PLAN.md beside it). First the recipe drafter brought back from session 46 (staged in
# /tmp/runs/seed0 by stage_drafter.sh) decoding live at T=1 with sampled drafts and with greedy drafts (the serving
# rule), both through its compiled layers; then the GPU default with twice its synthetic prompts (issue 23), replay
# and live at T=0; then every CUDA test, killed at 300 s; then both rules at T=0.7. The most wanted goes first: what
# the device time does not reach is left out.   bash live_then_quick.sh
set -u
run=/tmp/runs/seed0
quick=/tmp/runs/quick10k
common="show_progress=false logging.wandb.mode=disabled"
sets="eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
live="eval.mode=live eval.compile_drafter=true $sets"
measure() {  # temperature, draft rule
  python3 -m dflash.eval +experiment=smollm2 run_dir=$run $common $live eval.temperature=$1 eval.draft_sampling=$2 \
    eval.out_dir=$run/eval_live_t$1_$2
}
measure 1.0 sampled || exit 1
measure 1.0 greedy || exit 1
python3 -m dflash.train run_dir=$quick data.synthetic.count=10000 $common || exit 1
python3 -m dflash.eval run_dir=$quick $common eval.mode=live eval.temperature=0.0 $sets \
  eval.out_dir=$quick/eval_live_t0.0 || exit 1
timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider -W ignore -rfs --tb=short -m gpu tests \
  > $run/gputests.log 2>&1
tail -3 $run/gputests.log
measure 0.7 sampled || exit 1
measure 0.7 greedy
