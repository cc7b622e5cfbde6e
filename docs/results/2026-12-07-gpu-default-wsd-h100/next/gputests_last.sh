# The last call of session 48's plan (PLAN.md beside it): every CUDA test, on the machine the calls before staged
# (their assets and wheels stay in /tmp while it is warm), killed at $1 s; the log comes back in $OUT.
#   bash gputests_last.sh SECONDS
eval "$(bash launch/stage_assets.sh receive)"
test -f /tmp/dflash-stage/site/.complete || { echo "assets not staged"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -s KILL "$1" python3 -m pytest -q -p no:cacheprovider -W ignore -rfs --tb=short -m gpu tests \
  > "$OUT/gputests.log" 2>&1
echo "pytest exit status $?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gputests.log" | cut -c1-300 | tail -20
