#!/usr/bin/env bash
# Session 25's measuring call: the regeneration engine with sdpa and flex decode attention at HEAD, sdpa at 76128bc
# (before bc2e75d), live decoding before/after, then the CUDA tests of the engines and of row attention.
set -u
START=$(date +%s)
LIMIT=${LIMIT:-560}
left() { echo $((LIMIT - ($(date +%s) - START))); }
step() {  # step NAME SECONDS command...: run when that many seconds are left, log to $OUT/NAME.log
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "[main] skip $name ($(left) s left)" | tee -a "$OUT/main.log"; return; fi
  echo "[main] $name at $(( $(date +%s) - START )) s" | tee -a "$OUT/main.log"
  timeout "$(( $(left) < need * 3 ? $(left) : need * 3 ))" "$@" > "$OUT/$name.log" 2>&1
  echo "[main] $name rc=$? at $(( $(date +%s) - START )) s" | tee -a "$OUT/main.log"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
STAGE=/tmp/dflash-stage/site
export PYTHONPATH=$STAGE:/tmp/site:$PWD
{ nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
GEN="--target smollm2 --batch 1024 --prompts 4096 --max-new-tokens 256 --no-eager --refill on --hf-prompts 1 --fp32-prompts 1"
step generate_after 130 python3 bench/generate.py $GEN --attention sdpa flex --out "$OUT/generate_after.json"
step generate_before 60 env PYTHONPATH=$STAGE:/tmp/site:$PWD/.exp/before-76128bc \
  python3 .exp/before-76128bc/bench/generate.py $GEN --out "$OUT/generate_before.json"
SPEED="--live-drafters random --live-engine static --live-prompts 8 --replay-prompts 1 --profile-temperature 1.0 --profile-draft-sampling sampled"
step speed_after 45 python3 bench/eval_speed.py $SPEED --out "$OUT/speed_after.json"
step speed_before 45 env PYTHONPATH=$STAGE:/tmp/site:$PWD/.exp/before-76128bc \
  python3 .exp/before-76128bc/bench/eval_speed.py $SPEED --out "$OUT/speed_before.json"
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/test_row_attention.py \
  tests/test_static_decode.py tests/test_static_windows.py tests/test_eval_cuda_graphs.py tests/test_engine_attention.py
echo "[main] done at $(( $(date +%s) - START )) s" | tee -a "$OUT/main.log"
