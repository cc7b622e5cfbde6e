# Copies the repository to /tmp/repo (later calls replace the call's own copy) and starts exp.sh there, detached.
set -e
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
rm -rf /tmp/repo /tmp/exp /tmp/runs && mkdir -p /tmp/repo /tmp/exp
# HEAD's tree (git archive, carried in .exp/head): the working tree may hold unfinished edits
cp -r .exp/head/. /tmp/repo/
cp -r .gpu /tmp/repo/
cp .gpu/wait.sh .gpu/collect.sh /tmp/
cd /tmp/repo && setsid nohup bash .gpu/exp.sh > /tmp/exp/exp.log 2>&1 < /dev/null &
echo started
