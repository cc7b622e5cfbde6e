"""Train a DFlash drafter end to end: data -> capture -> train -> eval, under one run folder.

    python -m dflash.train                                  # embedded default: real SmolLM2-135M, CPU or one GPU
    python -m dflash.train +experiment=tiny                 # smoke test, tiny random target, < 1 minute on CPU
    python -m dflash.train +experiment=qwen36 target.path=/models/Qwen3.6-27B
    python -m dflash.train stages=[train,eval] train.epochs=3 name=my_run    # any Hydra override
    python -m dflash.train --help                           # main keys, groups, examples (conf/hydra/help/)

Several processes (the train stage runs on every rank, the others on rank 0):
    torchrun --nproc_per_node 2 -m dflash.train +experiment=tiny            # CPU (gloo) or 2 GPUs (NCCL)
    deepspeed --num_gpus 6 --module dflash.train +experiment=qwen36    # --local_rank=N is accepted
    launch/one_node.sh, launch/multi_node.sh, launch/slurm.sbatch           # capture GPUs + trainer GPUs
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from dflash.config import CONFIG_DIR
from dflash.pipeline import run_command


def strip_local_rank(argv: list[str]) -> list[str]:
    """Remove the `--local_rank=N` / `--local_rank N` the deepspeed launcher adds (Hydra rejects it) into LOCAL_RANK.

    The launcher also exports LOCAL_RANK; an existing value wins, as torch.distributed reads the environment.
    """
    kept, index = [], 0
    while index < len(argv):
        arg = argv[index]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            value = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and index + 1 < len(argv):
            value = argv[index + 1]
            index += 1
        else:
            kept.append(arg)
            index += 1
            continue
        if not value.isdigit():
            raise ValueError(f"--local_rank must be a non-negative integer, got {value!r}")
        os.environ.setdefault("LOCAL_RANK", value)
        index += 1
    return kept


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_command(cfg)


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *strip_local_rank(sys.argv[1:])]
    main()
