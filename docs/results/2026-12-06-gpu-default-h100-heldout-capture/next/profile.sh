# After run A, on the same warm machine: the evaluator's replay of run A's drafter drafted by the gathered step and
# by the fixed-shape step in one process (replay_drafting), a replay profile, live T=0 / T=1 step breakdowns.
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/repo
mkdir -p $OUT/prof
cd /tmp/repo
timeout ${EV_LIMIT:-240} python3 bench/eval_speed.py --drafter /tmp/runs/quick/export_best --replay-prompts 100 \
  --replay-drafting --replay-profile 4 --live-drafters trained --live-engine static --live-prompts ${LIVE:-4} \
  --profile-temperature 1.0 --profile-draft-sampling sampled --out $OUT/prof/eval_speed.json > /tmp/exp/ev.log 2>&1
echo "EVAL rc=$?"; grep "^\[eval_speed\]" /tmp/exp/ev.log | cut -c 1-1500; tail -3 /tmp/exp/ev.log
cp /tmp/exp/ev.log $OUT/prof/ 2>/dev/null
