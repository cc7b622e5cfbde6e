# Plan B's job (PLAN.md beside it), for a checkout without the brought-back drafter: the GPU default with twice its
# synthetic prompts (issue 23), then its drafter decoding live at T=1 with sampled drafts and with greedy drafts (the
# serving rule), both through its compiled layers, then at T=0; then every CUDA test, killed at 300 s. The most wanted
# goes first: what the device time does not reach is left out.   bash quick_then_live.sh
set -u
quick=/tmp/runs/quick10k
common="show_progress=false logging.wandb.mode=disabled"
sets="eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
live="eval.mode=live eval.compile_drafter=true $sets"
python3 -m dflash.train run_dir=$quick data.synthetic.count=10000 $common || exit 1
for rule in sampled greedy; do
  python3 -m dflash.eval run_dir=$quick $common $live eval.temperature=1.0 eval.draft_sampling=$rule \
    eval.out_dir=$quick/eval_live_t1.0_$rule || exit 1
done
python3 -m dflash.eval run_dir=$quick $common $live eval.temperature=0.0 eval.out_dir=$quick/eval_live_t0.0 || exit 1
timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider -W ignore -rfs --tb=short -m gpu tests \
  > $quick/gputests.log 2>&1
tail -3 $quick/gputests.log
