# The GPU tests of the change (the fixed-shape replay step, the ZeRO host work) on the device, from /tmp/head.
export PYTHONPATH=/tmp/dflash-stage/site:/tmp/site:/tmp/head PYTHONUNBUFFERED=1
cd /tmp/head
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_chunk_drafts.py 2>&1 | tail -15
echo "GPUTESTS rc=${PIPESTATUS[0]}"
timeout 60 python3 -m pytest -q -p no:cacheprovider -x tests/test_zero_step_host_work.py 2>&1 | tail -8
echo "ENGINE TESTS rc=${PIPESTATUS[0]}"
