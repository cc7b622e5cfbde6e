# Starts run B detached (after run A is done): bash .gpu/startB.sh "<overrides>"
set -e
test -f /tmp/exp/done || { echo "run A not done"; exit 1; }
echo "$1" > /tmp/exp/b.args
cp .gpu/expB.sh .gpu/waitB.sh /tmp/repo/.gpu/ && cp .gpu/waitB.sh /tmp/
cd /tmp/repo && setsid nohup bash .gpu/expB.sh > /tmp/exp/expB.log 2>&1 < /dev/null &
echo "started B: $1"
