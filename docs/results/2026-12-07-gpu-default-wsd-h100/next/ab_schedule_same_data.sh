# The job of session 48's plan (PLAN.md beside it): the GPU default with twice its synthetic prompts trained twice on
# the same data and features, under the default cosine (decay ratio 1) and under warmup-stable-decay
# (train.decay_ratio=0.3, session 48's run: replay 2.85), each evaluated by replay; the second training moves the
# first drafter aside with overwrite=true (data and features kept), and the first's evaluation is copied to $run/first/
# before that. Session 48's WSD run and session 47's cosine run drew different synthetic prompts (the static engine's
# sampling changed between them): this is the comparison on one data set.   bash ab_schedule_same_data.sh 0.3 1.0
# The ratios train from the largest down, whatever order they are given in (session 49, after ~360 s of refused
# starts): the cosine first, so that a lease that ends during the second training still leaves the baseline, on data
# that should be session 48's own (its static engine draws the same synthetic prompts; data_stats.json says).
set -u
set -- $(printf '%s\n' "$@" | sort -gr)
first=$1 second=$2
run=/tmp/runs/ab
common="run_dir=$run data.synthetic.count=10000 show_progress=false logging.wandb.mode=disabled"
python3 -m dflash.train $common train.decay_ratio=$first || exit 1
mkdir -p $run/first && cp -r $run/eval $run/metrics.jsonl $run/config.yaml $run/data/stats.json $run/first/
python3 -m dflash.train $common train.decay_ratio=$second overwrite=true
