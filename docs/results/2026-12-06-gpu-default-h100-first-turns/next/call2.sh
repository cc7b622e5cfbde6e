# Call 2 (.whl-b, part-2): every CUDA test (`-m gpu`, 49 tests since session 36), killed at $2 seconds (default 150;
# the loop's SIGTERM handler outlasts a plain timeout), then the full recipe (full.sh) detached from this call's tree,
# waited for up to $1 seconds and collected. $2 = 0: no tests.
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
mkdir -p /tmp/exp $OUT/prof
if [ "${2:-150}" -gt 0 ]; then
  PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:$PWD timeout -s KILL ${2:-150} python3 -m pytest -q -p no:cacheprovider \
    -W ignore -rfs --tb=short -m gpu tests > $OUT/prof/gputests.log 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/prof/gputests.log | cut -c1-300 | tail -20
fi
rm -rf /tmp/repo /tmp/runs && mkdir -p /tmp/repo
tar --exclude=./.stage --exclude='./.whl*' -cf - . | tar -xf - -C /tmp/repo
cp .gpu/wait.sh .gpu/collect.sh /tmp/
(cd /tmp/repo && setsid nohup bash .gpu/full.sh > /tmp/exp/exp.log 2>&1 < /dev/null &)
echo started; RUN=/tmp/runs/full bash /tmp/wait.sh ${1:-360}
