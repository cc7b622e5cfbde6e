"""A trained run is never lost: a run folder that holds a drafter trained under other data, capture or train
settings refuses a command of these settings before any work, unless it says overwrite=true (the train stage then
moves that drafter aside, never deletes it). Other eval settings evaluate the same drafter and are fine."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from dflash.config import fingerprints
from dflash.config.errors import RunFolderError
from dflash.run_files import CHECKPOINT_KEY, read_json_or_none
from dflash.stages.train import SETTINGS_KEY, TrainStage


def trained_keys(train: TrainStage) -> tuple[str, str | None] | None:
    """(checkpoint fingerprint, settings fingerprint or None when not recorded) of the drafter trained in the run
    folder (its train or export done marker's, else its checkpoints'), or None when nothing was trained there."""
    from dflash.train.best_checkpoint import read_best
    from dflash.train.checkpoints import complete_tags

    marker = read_json_or_none(os.path.join(train.checkpoints, CHECKPOINT_KEY))
    checkpoints = marker.get("fingerprint") if isinstance(marker, dict) else "unfingerprinted"
    settings = (read_json_or_none(os.path.join(train.checkpoints, SETTINGS_KEY)) or {}).get("fingerprint")
    # export/done.json alone: a run folder where training and export were one stage, whose marker it held.
    for folder in (train.out, train.context.dirs["export"]):
        done = read_json_or_none(os.path.join(folder, "done.json"))
        if isinstance(done, dict) and "checkpoint" in done:
            return done["checkpoint"], settings if done["checkpoint"] == checkpoints else None
    if not complete_tags(train.checkpoints) and read_best(train.checkpoints) is None:
        return None
    return checkpoints, settings


def refuse_other_trained_settings(train: TrainStage) -> None:
    """RunFolderError (one line naming what changed and the two ways on) when the run folder's trained drafter is
    of other data, capture or train settings than this command's."""
    run = train.context
    trained = trained_keys(train)
    if run.settings.overwrite or trained is None:
        return
    # The settings alone when recorded: the data stage may not have (re)made its files yet.
    if trained[1] == fingerprints.settings_fingerprint(run.settings) or \
            trained[1] is None and trained[0] == train.checkpoint_fingerprint():
        return
    old = None
    for path in (os.path.join(train.checkpoints, "config.yaml"), os.path.join(run.run_dir, "config.yaml")):
        if os.path.exists(path):
            old = OmegaConf.to_container(OmegaConf.load(path))
            break
    changes = fingerprints.training_changes(old, run.settings) if isinstance(old, dict) else []
    shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    parent, name = os.path.split(run.run_dir)
    free = next(f"{name}-{k}" for k in range(2, 10_000) if not os.path.exists(os.path.join(parent, f"{name}-{k}")))
    raise RunFolderError(
        f"{run.run_dir} holds a drafter trained with other settings ({shown or 'see its config.yaml'}); nothing "
        f"was changed. To train these settings beside it, run the same command with name={free} (or another "
        f"run_dir); to move the trained drafter aside (kept in {train.checkpoints}.<its fingerprint>) and train "
        f"these settings in its place, add overwrite=true")
