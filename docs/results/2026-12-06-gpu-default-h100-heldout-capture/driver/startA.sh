# Starts run A (exp.sh) detached: from the change's tree if its GPU tests passed in call 1, else from main's.
set -e
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
rm -rf /tmp/repo /tmp/runs && mkdir -p /tmp/repo /tmp/exp
if grep -q "GPUTESTS rc=0" /tmp/exp/gputests.log; then cp -r /tmp/head/. /tmp/repo/; echo "RUN A FROM head";
else cp -r /tmp/before/. /tmp/repo/; echo "RUN A FROM before"; fi
cp -r .gpu /tmp/repo/ && cp .gpu/wait.sh .gpu/collect.sh /tmp/
cd /tmp/repo && setsid nohup bash .gpu/exp.sh > /tmp/exp/exp.log 2>&1 < /dev/null &
echo started
