"""Run the capture stage alone (the data stage first when its output is missing).

    python -m dflash.extract +experiment=tiny
    python -m dflash.extract +experiment=qwen36 target.path=/models/Qwen3.6-27B
    python -m dflash.extract --help           # main keys, groups, examples (conf/hydra/help/extract.yaml)

Several capture processes (offline capture: rank r captures the shards i with i % WORLD_SIZE == r on its own
device, cuda:LOCAL_RANK or CPU; the data stage runs on rank 0 first; every rank must see the same run_dir):
    torchrun --nproc_per_node 2 -m dflash.extract +experiment=tiny                   # CPU (gloo) or 2 GPUs
    deepspeed --num_gpus 8 --module dflash.extract +experiment=qwen36 target.path=...  # --local_rank=N accepted
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 --master_addr HOST --master_port 29500 \\
        -m dflash.extract +experiment=qwen36 run_dir=/shared/runs/qwen36                # on each of two nodes
"""

import sys

import hydra
from omegaconf import DictConfig

from dflash.config import CONFIG_DIR
from dflash.config.command_line import command_arguments
from dflash.pipeline import run_command


@hydra.main(config_path=CONFIG_DIR, config_name="extract", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_command(cfg, ["data", "capture"])


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *command_arguments(sys.argv[1:], "extract")]
    main()
