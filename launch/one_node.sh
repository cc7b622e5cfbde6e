#!/usr/bin/env bash
# One node: data + capture on capture.devices, then the DeepSpeed trainer on train.devices, then eval.
# Usage: launch/one_node.sh [hydra overrides...]   e.g. launch/one_node.sh +experiment=qwen36 target.path=/models/x
set -euo pipefail
devices() {  # print a Hydra list key of the composed config as a comma list, e.g. "2,3,4,5,6,7"
  python - "$1" "${@:2}" <<'PY'
import sys
from dflash.config import compose
cfg = compose(sys.argv[2:])
node = cfg
for part in sys.argv[1].split("."):
    node = node[part]
print(",".join(str(d) for d in node) if node is not None else "")
PY
}
capture_devices=$(devices capture.devices "$@")
train_devices=$(devices train.devices "$@")
nproc=$(awk -F, '{print NF}' <<<"${train_devices:-0}")
CUDA_VISIBLE_DEVICES=${capture_devices:-0} python -m dflash.train "$@" 'stages=[data,capture]'
CUDA_VISIBLE_DEVICES=${train_devices:-0} torchrun --standalone --nproc_per_node "${nproc:-1}" \
  -m dflash.train "$@" 'stages=[train]'
CUDA_VISIBLE_DEVICES=${capture_devices:-0} python -m dflash.train "$@" 'stages=[eval]'
