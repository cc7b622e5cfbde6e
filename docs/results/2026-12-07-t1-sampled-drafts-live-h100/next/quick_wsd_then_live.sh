# The job of session 47's plan (PLAN.md beside it): the GPU default with twice its synthetic prompts (data as session
# 47's quick10k, ../../2026-12-07-gpu-default-syn10k-h100/) under a warmup-stable-decay schedule
# (train.decay_ratio=$1: the peak LR held until the last $1 of the steps), then its drafter live at T=0 and at T=1
# with sampled drafts, both through its compiled layers; then the same data under decay ratio $2 in the same folder
# (overwrite=true moves the first drafter aside, keeping data and features), replay only. The most wanted goes first:
# what the device time does not reach is left out.   bash quick_wsd_then_live.sh 0.3 0.15
set -u
first=$1 second=$2
run=/tmp/runs/wsd
common="run_dir=$run data.synthetic.count=10000 show_progress=false logging.wandb.mode=disabled"
sets="eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
live="eval.mode=live eval.compile_drafter=true $sets"
python3 -m dflash.train $common train.decay_ratio=$first || exit 1
python3 -m dflash.eval $common train.decay_ratio=$first $live eval.temperature=0.0 \
  eval.out_dir=$run/eval_live_t0.0 || exit 1
python3 -m dflash.eval $common train.decay_ratio=$first $live eval.temperature=1.0 eval.draft_sampling=sampled \
  eval.out_dir=$run/eval_live_t1.0_sampled || exit 1
mkdir -p $run/first && cp -r $run/eval $run/eval_live_t0.0 $run/eval_live_t1.0_sampled $run/metrics.jsonl \
  $run/config.yaml $run/first/
python3 -m dflash.train $common train.decay_ratio=$second overwrite=true
