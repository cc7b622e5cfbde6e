# Sourced at the start of every device call: wheels (when carried) into /tmp/site, asset parts into /tmp/dflash-stage.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD
eval "$(bash launch/stage_assets.sh receive)"
echo "PYTHONPATH=$PYTHONPATH"; ls /tmp/dflash-stage/site 2>/dev/null; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
