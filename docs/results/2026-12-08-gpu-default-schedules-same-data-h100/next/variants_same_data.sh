# GPU-default variants trained on one data set, each starting on a warm machine (a later session's job; PLAN.md
# beside it, and docs/results.md's queue): the data and features once, then a 30-step training that compiles the
# drafter's layers, so that no variant pays the fresh machine's start-up (~45 s of the 7.25-minute budget in session
# 49, 11% of the steps); then the GPU default itself (the baseline) and each variant given, with overwrite=true (the
# data and features kept), each one's evaluation copied to $run/variants/<k>/ (0: the baseline).
#   bash variants_same_data.sh train.num_anchors=96 'train.gamma=4'
# ~110 s of data, ~60 s of warm-up, ~490 s a training with its replay: the baseline and one variant fit a session
# beside staging and the CUDA tests, two without the tests.
set -u
run=/tmp/runs/variants
common="run_dir=$run show_progress=false logging.wandb.mode=disabled"
python3 -m dflash.train $common train.max_steps=30 train.max_minutes=null 'stages=[data,capture,train]' || exit 1
k=0
for variant in "" "$@"; do
  python3 -m dflash.train $common $variant overwrite=true || exit 1
  mkdir -p $run/variants/$k && cp -r $run/eval $run/metrics.jsonl $run/config.yaml $run/variants/$k/
  echo "variant $k: ${variant:-the GPU default}" >> $run/variants/index.txt
  k=$((k + 1))
done
