# Call 2 (.whl-b, part-2): the GPU tests (the colocated forward as CUDA graphs, the fixed-shape drafting step), then
# run A (exp.sh) detached from this call's tree, waited for up to $1 seconds and collected.
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
mkdir -p /tmp/exp $OUT/prof
PYTHONPATH=/tmp/site:$PWD timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_static_capture.py \
  tests/test_chunk_drafts.py tests/test_engine_device_waits.py 2>&1 | tail -12 | tee $OUT/prof/gputests.log
rm -rf /tmp/repo /tmp/runs && mkdir -p /tmp/repo
tar --exclude=./.stage --exclude='./.whl*' -cf - . | tar -xf - -C /tmp/repo
cp .gpu/wait.sh .gpu/collect.sh /tmp/
(cd /tmp/repo && setsid nohup bash .gpu/exp.sh > /tmp/exp/exp.log 2>&1 < /dev/null &)
echo started; bash /tmp/wait.sh ${1:-420}
