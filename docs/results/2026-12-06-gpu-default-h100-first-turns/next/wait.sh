# Waits up to $1 seconds for the run started by call2.sh to finish (printing its log's tail), then collects.
limit=${1:-540}; t=0
while [ ! -f /tmp/exp/done ] && [ $t -lt $limit ]; do sleep 10; t=$((t + 10)); done
tail -40 /tmp/exp/exp.log; tail -5 /tmp/exp/recipe.log
bash /tmp/collect.sh
