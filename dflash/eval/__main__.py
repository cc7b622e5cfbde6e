"""Evaluate the exported drafter of a run against its target: tau, acceptance rate, per position, per prompt set.

    python -m dflash.eval +experiment=tiny
    python -m dflash.eval name=my_run eval.max_new_tokens=256 eval.prompt_sets.gsm8k.limit=100
    python -m dflash.eval --help                 # main keys, groups, examples (conf/hydra/help/eval.yaml)
"""

import sys

import hydra
from omegaconf import DictConfig

from dflash.config import CONFIG_DIR
from dflash.config.command_line import command_arguments
from dflash.pipeline import run_command


@hydra.main(config_path=CONFIG_DIR, config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_command(cfg, ["eval"])


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *command_arguments(sys.argv[1:], "eval")]
    main()
