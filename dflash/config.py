"""Where the Hydra configs live, and composing them outside a Hydra main (tests, notebooks)."""

from __future__ import annotations

import os

from omegaconf import DictConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """The config `python -m dflash.train <overrides>` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
