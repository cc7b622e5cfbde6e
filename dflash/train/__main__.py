"""Train a DFlash drafter end to end: data -> capture -> train -> eval, under one run folder.

    python -m dflash.train                                  # the default: real SmolLM2-135M; a CPU demo, or on a GPU a
                                                            # real drafter in ~10 min (+experiment=smollm2_quick)
    python -m dflash.train +experiment=tiny                 # smoke test, tiny random target, seconds on a CPU
    python -m dflash.train +experiment=qwen36 target.path=/models/Qwen3.6-27B
    python -m dflash.train stages=[train,eval] train.epochs=3 name=my_run    # any Hydra override
    python -m dflash.train --help                           # main keys, groups, examples (conf/hydra/help/)

Several processes (the train stage runs on every rank, the others on rank 0):
    torchrun --nproc_per_node 2 -m dflash.train +experiment=tiny            # CPU (gloo) or 2 GPUs (NCCL)
    deepspeed --num_gpus 6 --module dflash.train +experiment=qwen36    # --local_rank=N is accepted
    launch/one_node.sh, launch/multi_node.sh, launch/slurm.sbatch           # capture GPUs + trainer GPUs
"""

import sys

import hydra
from omegaconf import DictConfig

from dflash.config import CONFIG_DIR
from dflash.config.command_line import command_arguments
from dflash.pipeline import run_command


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_command(cfg)


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *command_arguments(sys.argv[1:])]
    main()
