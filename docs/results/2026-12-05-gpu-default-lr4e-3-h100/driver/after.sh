#!/usr/bin/env bash
# Call D (after start.sh + wait.sh in call C): finish and collect the quick run, then the live guard before/after
# bc2e75d (issue 19), then live T=1 and T=0 evaluations of the quick drafter (issue 18's speedups) while time is
# left (LIMIT seconds for the whole call). Everything goes into $OUT/bench.tar.gz (a call returns <= 8 files).
set -u
LIMIT=${LIMIT:-560}
HERE=$PWD
B=/tmp/bench && mkdir -p $B
pack() { tar -C /tmp -czf $OUT/bench.tar.gz bench; }
bash /tmp/wait.sh ${WAIT:-300}
cd /tmp/repo
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:$PWD PYTHONUNBUFFERED=1
SPEED="--live-drafters random --live-engine static --live-prompts 8 --replay-prompts 1 --profile-temperature 1.0 --profile-draft-sampling sampled"
for tree in after before; do
  root=/tmp/repo; [ $tree = before ] && root=$HERE/.exp/before-76128bc
  echo "[after] speed $tree at $SECONDS s"
  PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:$root timeout 100 python3 $root/bench/eval_speed.py $SPEED \
    --out $B/speed_$tree.json > $B/speed_$tree.log 2>&1; echo "rc=$?"
done
pack
RUN="+experiment=smollm2_quick run_dir=/tmp/runs/quick show_progress=false logging.wandb.mode=disabled train.lr=4e-3"
LIVE="eval.mode=live eval.measure_target=true eval.prompt_sets.humaneval.limit=16 eval.prompt_sets.mtbench.limit=16 eval.prompt_sets.gsm8k.limit=16"
for t in 1 0; do
  left=$((LIMIT - SECONDS)); [ $left -lt 60 ] && { echo "[after] skip live T=$t ($left s left)"; continue; }
  echo "[after] live T=$t at $SECONDS s"
  drafts=greedy; [ $t = 1 ] && drafts=sampled
  timeout $left python3 -m dflash.eval $RUN $LIVE eval.temperature=$t eval.draft_sampling=$drafts \
    eval.out_dir=/tmp/runs/quick/eval_live_t$t > $B/live_t$t.log 2>&1; echo "rc=$?"
  cp /tmp/runs/quick/eval_live_t$t/summary.json $B/live_t${t}_summary.json 2>/dev/null
  tail -25 $B/live_t$t.log
  pack
done
echo "[after] done at $SECONDS s"
