# The job of session 45's plan (PLAN.md beside it): the smollm2 recipe into RUN_DIR, then live decoding of its drafter
# (16 prompts a set), each into its own folder of the run: at T=1 (the serving rule's greedy drafts, the default),
# at T=0, and at T=0 through the drafter's compiled layers (eval.compile_drafter=true). The most wanted goes first:
# what the device time does not reach is left out. Further arguments are overrides of every command.
#   bash recipe_then_live.sh /tmp/runs/seed0
set -u
run_dir=$1
shift
common="+experiment=smollm2 run_dir=$run_dir show_progress=false logging.wandb.mode=disabled $*"
live="eval.mode=live eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
python3 -m dflash.train $common || exit 1
python3 -m dflash.eval $common $live eval.temperature=1.0 eval.out_dir=$run_dir/eval_live_t1.0 || exit 1
python3 -m dflash.eval $common $live eval.temperature=0.0 eval.out_dir=$run_dir/eval_live_t0.0 || exit 1
python3 -m dflash.eval $common $live eval.temperature=0.0 eval.compile_drafter=true \
  eval.out_dir=$run_dir/eval_live_t0.0_compiled
