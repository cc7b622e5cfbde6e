"""Training metrics to metrics.jsonl (always), TensorBoard and wandb (offline unless configured otherwise)."""

from __future__ import annotations

import json
import os
from typing import Any


class MetricsLog:
    """Writes on rank 0 only; every other rank gets a log that accepts and drops records."""

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, wandb_mode: str, wandb_project: str,
                 config: dict[str, Any]) -> None:
        self.enabled = enabled
        self._tensorboard = None
        self._wandb = None
        self._file = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=run_dir, mode=wandb_mode, config=config,
                                     reinit="finish_previous")

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in values.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
