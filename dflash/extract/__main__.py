"""Run the capture stage alone (the data stage first when its output is missing).

    python -m dflash.extract +experiment=tiny
    python -m dflash.extract +experiment=qwen36 target.path=/models/Qwen3.6-27B
"""

import hydra
from omegaconf import DictConfig

from dflash.config import CONFIG_DIR
from dflash.pipeline import Pipeline


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    cfg.stages = ["data", "capture"]
    Pipeline(cfg).run()


if __name__ == "__main__":
    main()
