"""What the train stage exports: the final drafter to `export/` and the best held-out checkpoint to `export_best/`
(z-lab DFlashDraftModel format), and the training curve."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from dflash.run_files import checksum_problem, read_json_or_none, write_json

logger = logging.getLogger(__name__)


def export_state(state: dict[str, torch.Tensor], config, folder: str) -> None:
    """A drafter state dict (any dtype) exported to `folder`."""
    from dflash.eval.export import export_zlab
    from dflash.models.drafter import DFlashDraftModel

    drafter = DFlashDraftModel(config)
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    export_zlab(drafter, folder)


def export_best(run_dir: str, checkpoints: str, config) -> dict[str, Any] | None:
    """export_best/: the checkpoint with the best held-out tau (removed when there is none); returns its best.json
    (step, tau, acceptance rate), or None. An export of this best whose files differ from its checksums.json is
    named and exported again."""
    from dflash.train.best_checkpoint import best_state_dict, read_best

    folder = os.path.join(run_dir, "export_best")
    exported = read_json_or_none(os.path.join(folder, "best.json"))  # written last: the export is whole
    if exported is not None and exported == read_best(checkpoints):
        problem = checksum_problem(folder)
        if problem is None:
            return exported  # this best checkpoint is exported already (an eval of a stopped run, rerun)
        logger.warning(f"[train] warning: {folder} is corrupt: {problem}; exporting it again from {checkpoints}")
    best = best_state_dict(checkpoints)
    if best is None:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    export_state(best[0], config, folder)
    write_json(os.path.join(folder, "best.json"), best[1])
    logger.info(f"[train] best held-out checkpoint (step {best[1]['step']}, tau {best[1]['tau']:.3f}) -> {folder}")
    return best[1]


def plot_training_curve(run_dir: str) -> None:
    from dflash.train.curve_plot import plot_training_curve as plot

    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        path = plot(metrics, os.path.join(run_dir, "training_curve.png"))
        logger.info(f"[train] training curve -> {path}")
