"""Another split of the same global batch is the same training: a run folder's drafter trained with
`micro_batch_size x ranks x grad_accum` sequences a step resumes (or, finished, is kept) under a launch whose
product is the same, on another number of ranks (after losing a node) or with smaller micro-batches (after running
out of memory). The data order, the anchors and the loss's normalisation depend on the global batch alone
(dflash/train/loop.py), and a checkpoint loads on another number of ranks (dflash/train/checkpoints.py, resume_tag).

`train.micro_batch_size` and `train.grad_accum` are in the train stage's fingerprint, so a launch of another split
would count as other settings. Instead the run folder keeps the fingerprints of the split its training started
with: a launch whose split differs but whose global batch equals the recorded one is fingerprinted with the
recorded split (`fingerprinted`) where the training there is of these settings under it, so every stage and the
run folder's guard take it for the same training: no fingerprint or done marker changes, and nothing is moved
aside. The split is recorded in checkpoints/settings.json beside the settings fingerprint it was taken with, with
the global batch and rank count of the last launch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import OmegaConf

from dflash.config.schema import RunSettings
from dflash.run_files import SETTINGS_KEY, read_json_or_none


@dataclasses.dataclass(frozen=True)
class RecordedSplit:
    """The split the run folder's training is fingerprinted with, and the global batch and rank count of the last
    launch that trained there."""

    micro_batch_size: int
    grad_accum: int
    global_batch: int
    ranks: int


def settings_record(checkpoints: str) -> dict[str, Any]:
    """checkpoints/settings.json: the settings fingerprint of the training there, its split and the command of its
    last launch; {} where there is none."""
    record = read_json_or_none(os.path.join(checkpoints, SETTINGS_KEY))
    return record if isinstance(record, dict) else {}


def split_record(fingerprinted: RunSettings, launch: RunSettings, ranks: int) -> dict[str, int]:
    """What settings.json records of the split: the one the fingerprints were taken with (of `fingerprinted`), and
    the global batch and rank count of this launch of `launch` on `ranks` ranks (the one whose command is
    recorded beside it)."""
    t = launch.train
    return {"micro_batch_size": fingerprinted.train.micro_batch_size, "grad_accum": fingerprinted.train.grad_accum,
            "global_batch": t.micro_batch_size * ranks * t.grad_accum, "ranks": ranks}


def recorded_split(checkpoints: str) -> RecordedSplit | None:
    """The split of the training in `checkpoints` (settings.json's record; for a folder from before it, the
    config.yaml its training wrote there), with the global batch and rank count of the last launch that trained
    there (settings.json's record, else its newest complete tag's layout.json); None where any is not recorded."""
    from dflash.train.checkpoints import complete_tags, saved_layout

    split = settings_record(checkpoints).get("split")
    if not isinstance(split, dict):
        split = config_split(os.path.join(checkpoints, "config.yaml")) or {}
    if not all(isinstance(split.get(key), int) for key in ("global_batch", "ranks")):
        tags = complete_tags(checkpoints)
        layout = saved_layout(checkpoints, tags[-1][1]) if tags else {}
        split = {**split, "global_batch": layout.get("global_batch_size"), "ranks": layout.get("world_size")}
    if not all(isinstance(split.get(key), int) for key in ("micro_batch_size", "grad_accum", "global_batch",
                                                           "ranks")):
        return None
    return RecordedSplit(split["micro_batch_size"], split["grad_accum"], split["global_batch"], split["ranks"])


def config_split(path: str) -> dict[str, Any] | None:
    """train.micro_batch_size and train.grad_accum of a resolved config.yaml, or None where it has none."""
    if not os.path.exists(path):
        return None
    train = (OmegaConf.to_container(OmegaConf.load(path)) or {}).get("train")
    return train if isinstance(train, dict) else None


def fingerprinted(settings: RunSettings, recorded: RecordedSplit | None, ranks: int) -> RunSettings:
    """`settings` with the recorded split where this launch of `ranks` ranks splits the recorded global batch
    otherwise; else `settings` themselves (the same split, another global batch, or nothing recorded)."""
    t = settings.train
    if recorded is None or (t.micro_batch_size, t.grad_accum) == (recorded.micro_batch_size, recorded.grad_accum):
        return settings
    if t.micro_batch_size * ranks * t.grad_accum != recorded.global_batch:
        return settings
    train = dataclasses.replace(t, micro_batch_size=recorded.micro_batch_size, grad_accum=recorded.grad_accum)
    return dataclasses.replace(settings, train=train)


def counted_ranks(settings: RunSettings, world_size: int, recorded: RecordedSplit) -> int:
    """The ranks a command's split is counted on: its own `world_size` where it trains, else those of the last
    launch that trained (an evaluation is one process, whatever the training's ranks were)."""
    return world_size if "train" in settings.stages else recorded.ranks


def keeping_batch(global_batch: int, micro_batch_size: int, ranks: int, grad_accum: int) -> str | None:
    """The override that makes a launch of `ranks` ranks split `global_batch` (train.grad_accum at this micro-batch
    size, else train.micro_batch_size at this accumulation), or None when neither divides it."""
    if global_batch % (micro_batch_size * ranks) == 0:
        return f"train.grad_accum={global_batch // (micro_batch_size * ranks)}"
    if global_batch % (ranks * grad_accum) == 0:
        return f"train.micro_batch_size={global_batch // (ranks * grad_accum)}"
    return None
