#!/usr/bin/env bash
# One node: data on the first capture GPU, capture on capture.devices (offline: one torchrun process per GPU, each
# capturing its share of the shards), the DeepSpeed trainer on train.devices, then eval.
# Usage: launch/one_node.sh [hydra overrides...]   e.g. launch/one_node.sh +experiment=qwen36 target.path=/models/x
set -euo pipefail
setting() {  # print a key of the composed config; a list as a comma list, e.g. "2,3,4,5,6,7"
  python - "$1" "${@:2}" <<'PY'
import sys
from dflash.config import compose
from omegaconf import ListConfig
cfg = compose(sys.argv[2:])
node = cfg
for part in sys.argv[1].split("."):
    node = node[part]
if node is None:
    print("")
elif isinstance(node, ListConfig):
    print(",".join(str(d) for d in node))
else:
    print(node)
PY
}
capture_devices=$(setting capture.devices "$@")
train_devices=$(setting train.devices "$@")
capture_mode=$(setting capture.mode "$@")
ncapture=$(awk -F, '{print NF}' <<<"${capture_devices:-0}")
first_capture=${capture_devices%%,*}
first_capture=${first_capture:-0}
nproc=$(awk -F, '{print NF}' <<<"${train_devices:-0}")
CUDA_VISIBLE_DEVICES=$first_capture python -m dflash.train "$@" 'stages=[data]'
if [ "$capture_mode" = offline ]; then
  CUDA_VISIBLE_DEVICES=${capture_devices:-0} torchrun --standalone --nproc_per_node "${ncapture:-1}" \
    -m dflash.train "$@" 'stages=[capture]'
else  # online / colocated: the capture stage only prepares what the train stage's capture needs
  CUDA_VISIBLE_DEVICES=$first_capture python -m dflash.train "$@" 'stages=[capture]'
fi
CUDA_VISIBLE_DEVICES=${train_devices:-0} torchrun --standalone --nproc_per_node "${nproc:-1}" \
  -m dflash.train "$@" 'stages=[train]'
CUDA_VISIBLE_DEVICES=$first_capture python -m dflash.train "$@" 'stages=[eval]'
