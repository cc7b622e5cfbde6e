#!/usr/bin/env bash
# Session 25, second machine: the live-decoding guard before (76128bc) and after (HEAD), random drafter, static engine.
set -u
START=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
STAGE=/tmp/dflash-stage/site
{ nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/gpu.txt" 2>&1
SPEED="--live-drafters random --live-engine static --live-prompts 8 --replay-prompts 1 --profile-temperature 1.0 --profile-draft-sampling sampled"
for tree in after before; do
  root=$PWD; [ $tree = before ] && root=$PWD/.exp/before-76128bc
  echo "[speed] $tree at $(( $(date +%s) - START )) s" | tee -a "$OUT/main.log"
  PYTHONPATH=$STAGE:/tmp/site:$root timeout 100 python3 $root/bench/eval_speed.py $SPEED --out "$OUT/speed_$tree.json" \
    > "$OUT/speed_$tree.log" 2>&1
  echo "[speed] $tree rc=$? at $(( $(date +%s) - START )) s" | tee -a "$OUT/main.log"
done
