# Call 2 (.whl-b, part-2): the CUDA tests of the files this session changed, chosen by name (the others train the
# tiny CPU demo, which a machine with a GPU refuses; not every CUDA test carried the gpu mark), killed at $2 s (150; the
# loop's SIGTERM handler outlasts a plain timeout), then run A (exp.sh: the README's first command) detached from this
# call's tree, waited for up to $1 seconds and collected.
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
mkdir -p /tmp/exp $OUT/prof
PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:$PWD timeout -s KILL ${2:-150} python3 -m pytest -q -p no:cacheprovider \
  -W ignore -rfs --tb=short tests/test_feature_memory.py tests/test_colocated.py tests/test_step_profile.py \
  tests/test_static_capture.py \
  -k "on_cuda or graphs_replay or replay_in_the_graphs or bf16_graphs or trains_the_losses_of_one_without" \
  > $OUT/prof/gputests.log 2>&1
grep -E "^(FAILED|ERROR|E  )|passed|failed" $OUT/prof/gputests.log | cut -c1-300 | tail -20
rm -rf /tmp/repo /tmp/runs && mkdir -p /tmp/repo
tar --exclude=./.stage --exclude='./.whl*' -cf - . | tar -xf - -C /tmp/repo
cp .gpu/wait.sh .gpu/collect.sh /tmp/
(cd /tmp/repo && setsid nohup bash .gpu/exp.sh > /tmp/exp/exp.log 2>&1 < /dev/null &)
echo started; bash /tmp/wait.sh ${1:-360}
