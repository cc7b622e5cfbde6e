# Waits up to $1 seconds for run B, then collects both runs.
limit=${1:-540}; t=0
while [ ! -f /tmp/exp/doneB ] && [ $t -lt $limit ]; do sleep 10; t=$((t + 10)); done
tail -40 /tmp/exp/expB.log; tail -5 /tmp/exp/recipeB.log
bash /tmp/collect.sh
