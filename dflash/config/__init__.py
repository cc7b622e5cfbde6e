"""The run's settings: the typed schema (schema.py), its Hydra registration (store.py), composing a config outside
a Hydra main (tests, notebooks), and turning a composed config into checked settings objects."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from dflash.config.errors import ConfigError
from dflash.config.removed import refuse_removed_settings
from dflash.config.schema import RunSettings
from dflash.config.store import register
from dflash.config.unknown_keys import refuse_unknown_override_keys, refuse_unknown_settings

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")

register()


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """The config `python -m dflash.train <overrides>` would run with (ConfigError for a removed setting)."""
    refuse_removed_settings(list(overrides or []))
    refuse_unknown_override_keys(list(overrides or []), CONFIG_DIR)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def settings_from(cfg: DictConfig) -> RunSettings:
    """The composed config as checked RunSettings: every group's ranges, choices and combinations are checked
    here (ConfigError naming the key), before any stage starts."""
    refuse_unknown_settings(cfg)
    return OmegaConf.to_object(cfg)


__all__ = ["CONFIG_DIR", "ConfigError", "RunSettings", "compose", "settings_from"]
