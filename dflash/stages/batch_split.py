"""Another split of the same global batch is the same training: a run folder's drafter trained with
`micro_batch_size x ranks x grad_accum` sequences a step resumes (or, finished, is kept) under a launch whose
product is the same, on another number of ranks (after losing a node) or with smaller micro-batches (after running
out of memory). The data order, the anchors and the loss's normalisation depend on the global batch alone
(dflash/train/loop.py), and a checkpoint loads on another number of ranks (dflash/train/checkpoints.py, resume_tag).

`train.micro_batch_size` and `train.grad_accum` are in the train stage's fingerprint, so a launch of another split
would count as other settings. Instead the run folder keeps the fingerprints of the split its training started
with: a launch whose split differs but whose global batch equals the one its newest checkpoint recorded is
fingerprinted with the recorded split (`fingerprinted`), so every stage and the run folder's guard take it for
the same training, and nothing of the run folder is rewritten. The split is recorded in checkpoints/settings.json
beside the settings fingerprint it was taken with.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import OmegaConf

from dflash.config.schema import RunSettings
from dflash.run_files import read_json_or_none

SETTINGS_KEY = "settings.json"  # in checkpoints/: the settings fingerprint of the training that wrote them, its split


@dataclasses.dataclass(frozen=True)
class RecordedSplit:
    """The split the run folder's training is fingerprinted with, and the global batch and rank count of its newest
    complete checkpoint (the last launch that trained)."""

    micro_batch_size: int
    grad_accum: int
    global_batch: int
    ranks: int

    def overrides(self) -> str:
        return f"train.micro_batch_size={self.micro_batch_size} train.grad_accum={self.grad_accum}"


def split_record(settings: RunSettings) -> dict[str, int]:
    """What settings.json records of the split of `settings` (the ones its fingerprint was taken with)."""
    return {"micro_batch_size": settings.train.micro_batch_size, "grad_accum": settings.train.grad_accum}


def recorded_split(checkpoints: str) -> RecordedSplit | None:
    """The split of the training in `checkpoints` (settings.json's record; for a folder from before it, the
    config.yaml its training wrote there), with its newest complete tag's global batch and rank count; None
    without a complete tag that recorded its global batch, or without a record of the split."""
    from dflash.train.checkpoints import complete_tags, saved_layout

    tags = complete_tags(checkpoints)
    layout = saved_layout(checkpoints, tags[-1][1]) if tags else {}
    if not isinstance(layout.get("global_batch_size"), int) or not isinstance(layout.get("world_size"), int):
        return None
    split = (read_json_or_none(os.path.join(checkpoints, SETTINGS_KEY)) or {}).get("split")
    if not isinstance(split, dict):
        split = config_split(os.path.join(checkpoints, "config.yaml"))
    if split is None or not all(isinstance(split.get(key), int) for key in ("micro_batch_size", "grad_accum")):
        return None
    return RecordedSplit(split["micro_batch_size"], split["grad_accum"], layout["global_batch_size"],
                         layout["world_size"])


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


def keeping_batch(global_batch: int, micro_batch_size: int, ranks: int, grad_accum: int) -> str | None:
    """The override that makes a launch of `ranks` ranks split `global_batch` (train.grad_accum at this micro-batch
    size, else train.micro_batch_size at this accumulation), or None when neither divides it."""
    if global_batch % (micro_batch_size * ranks) == 0:
        return f"train.grad_accum={global_batch // (micro_batch_size * ranks)}"
    if global_batch % (ranks * grad_accum) == 0:
        return f"train.micro_batch_size={global_batch // (ranks * grad_accum)}"
    return None
