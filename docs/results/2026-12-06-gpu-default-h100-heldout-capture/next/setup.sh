# Sourced at the start of every device call: whichever wheel half is carried (.whl-a, .whl-b) into /tmp/site, the
# asset part carried into /tmp/dflash-stage (once both are there, PYTHONPATH gets the staged packages).
for d in .whl .whl-a .whl-b; do
  if ls $d/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl \
      || return 1
  fi
done
export PYTHONPATH=/tmp/site:$PWD
eval "$(bash launch/stage_assets.sh receive)"
echo "PYTHONPATH=$PYTHONPATH"; ls /tmp/dflash-stage/site 2>/dev/null; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
