"""Train a DFlash drafter end to end: data -> capture -> train -> eval, under one run folder.

    python -m dflash.train                                  # embedded default: real SmolLM2-135M, CPU or one GPU
    python -m dflash.train +experiment=tiny                 # smoke test, tiny random target, < 1 minute on CPU
    python -m dflash.train +experiment=qwen36 target.path=/models/Qwen3.6-27B
    python -m dflash.train stages=[train,eval] train.epochs=3 name=my_run    # any Hydra override

Several processes (the train stage runs on every rank, the others on rank 0):
    torchrun --nproc_per_node 2 -m dflash.train +experiment=tiny            # CPU (gloo) or 2 GPUs (NCCL)
    deepspeed --no_local_rank --num_gpus 6 --module dflash.train +experiment=qwen36
    launch/one_node.sh, launch/multi_node.sh, launch/slurm.sbatch           # capture GPUs + trainer GPUs
"""

import hydra
from omegaconf import DictConfig

from dflash.config import CONFIG_DIR
from dflash.pipeline import Pipeline


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    Pipeline(cfg).run()


if __name__ == "__main__":
    main()
