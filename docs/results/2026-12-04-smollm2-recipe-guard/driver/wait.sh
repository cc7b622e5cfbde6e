# Waits up to $1 seconds for the marker $2 (default done) that exp.sh leaves, printing the log's tail, then collects.
limit=${1:-540}; marker=${2:-done}; t=0
while [ ! -f /tmp/exp/$marker ] && [ $t -lt $limit ]; do sleep 10; t=$((t + 10)); done
tail -40 /tmp/exp/exp.log; tail -5 /tmp/exp/recipe.log
bash /tmp/collect.sh
