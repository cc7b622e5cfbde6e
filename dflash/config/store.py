"""Hydra's ConfigStore entries: the run schema and the group options that are nothing but schema defaults.

Options that set values (target presets, the qwen36 drafter, experiments) are YAML files under conf/ that override
only what differs from these defaults; the defaults themselves live in dflash/config/schema.py alone.
"""

from hydra.core.config_store import ConfigStore

from dflash.config.schema import (
    ColocatedCapture, DataSettings, DeepSpeedSettings, DrafterSettings, EvalSettings, LoggingSettings,
    OfflineCapture, OnlineCapture, RunSettings, TrainSettings,
)

RUN_SCHEMA = "run_schema"


def register() -> None:
    store = ConfigStore.instance()
    store.store(name=RUN_SCHEMA, node=RunSettings)
    store.store(group="drafter", name="small", node=DrafterSettings)
    store.store(group="data", name="sharegpt", node=DataSettings)
    store.store(group="capture", name="offline", node=OfflineCapture)
    store.store(group="capture", name="online", node=OnlineCapture)
    store.store(group="capture", name="colocated", node=ColocatedCapture)
    store.store(group="train", name="default", node=TrainSettings)
    for stage in (1, 2, 3):
        store.store(group="deepspeed", name=f"zero{stage}", node=DeepSpeedSettings(zero_stage=stage))
    store.store(group="eval", name="default", node=EvalSettings)
    store.store(group="logging", name="default", node=LoggingSettings)
