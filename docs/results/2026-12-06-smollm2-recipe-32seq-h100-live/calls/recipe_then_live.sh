# The job of this run (session 38): the smollm2 recipe into RUN_DIR, then live decoding of its drafter at each
# temperature of $TEMPERATURES (default "0.0 1.0"; 16 prompts a set), each into its own folder of the run. Further
# arguments are overrides of all three commands. This run was
#   bash recipe_then_live.sh /tmp/runs/full train.micro_batch_size=32
# (the recipe takes 32 sequences a step since), started detached by call2.sh of ../../2026-12-06-gpu-default-h100-live.
set -u
run_dir=$1
shift
common="+experiment=smollm2 run_dir=$run_dir show_progress=false logging.wandb.mode=disabled $*"
python3 -m dflash.train $common || exit 1
for t in ${TEMPERATURES:-0.0 1.0}; do
  python3 -m dflash.eval $common eval.mode=live eval.temperature=$t eval.out_dir=$run_dir/eval_live_t$t \
    eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16 || exit 1
done
