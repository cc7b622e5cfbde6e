# Call 2 (part-1): while it is here, the ZeRO step's host work on the GPU (DeepSpeed's defaults against dflash's).
mkdir -p $OUT/prof
cd /tmp/head && PYTHONPATH=/tmp/site:/tmp/head timeout 150 python3 bench/zero_step_host_work.py --steps 20 \
  > $OUT/prof/zero_step_host_work.json 2> /tmp/exp/zs.err
echo "ZERO rc=$?"; cat $OUT/prof/zero_step_host_work.json; tail -3 /tmp/exp/zs.err
