"""Training that diverges stops before anything non-finite is kept: no drafter with a non-finite weight, ever.

A step whose loss or gradient norm is NaN or infinite is a non-finite step. Under ZeRO 1-3 DeepSpeed's overflow
check skips its update, so the weights stay as they were; a few in a row (bf16 can give some in a run's first
steps) are allowed with a warning each, and train.max_nonfinite_steps in a row stop the run. This project trains in
bf16 or fp32: neither has a loss scaler, whose skipped steps (fp16) would be normal events rather than failures.

Weights that are not finite never recover, so the run stops at once when they are found: after a non-finite step
(ZeRO-0 applies its update), and before every checkpoint, best checkpoint and the export read them. An update from a
finite step can still make them so (an optimizer state holding NaN), which only these checks see. So no checkpoint,
best checkpoint or export ever holds a non-finite weight, and the error names the newest checkpoint, to resume from.
"""

from __future__ import annotations

import logging
import math
import os

from dflash.train.checkpoints import complete_tags
from dflash.train.engine import TrainEngine

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Training stopped on non-finite losses, gradients or weights; the message names the step and the newest
    checkpoint (all of whose weights are finite)."""


class DivergenceGuard:
    """Counts the non-finite steps in a row of one training call and checks the weights before they are kept.

    Every rank takes the same decisions: the loss and gradient norm it reads are global, and the weight check is
    agreed across ranks (TrainEngine.weights_finite)."""

    def __init__(self, limit: int, checkpoint_dir: str, rank: int) -> None:
        self.limit, self.checkpoint_dir, self.rank = limit, checkpoint_dir, rank
        self.in_a_row = 0

    def after_step(self, engine: TrainEngine, step: int, metrics: dict[str, float]) -> None:
        """Count step `step` (its record holds loss and, when DeepSpeed computed it, grad_norm): a finite one ends a
        run of non-finite steps; the limit-th non-finite step in a row, or non-finite weights, stop training."""
        figures = {key: metrics[key] for key in ("loss", "grad_norm") if metrics.get(key) is not None}
        if all(math.isfinite(value) for value in figures.values()):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        shown = ", ".join(f"{key} {value}" for key, value in figures.items())
        self.check_weights(engine, step)
        if self.in_a_row >= self.limit:
            raise self.diverged(step, f"{self.in_a_row} steps in a row had a non-finite loss or gradient norm "
                                      f"({shown} at step {step}; train.max_nonfinite_steps={self.limit})")
        if self.rank == 0:
            logger.warning(f"[train] warning: step {step}: {shown}; its update was skipped ({self.in_a_row} such "
                           f"step(s) in a row, training stops at {self.limit}: train.max_nonfinite_steps)")

    def check_weights(self, engine: TrainEngine, step: int) -> None:
        """TrainingDiverged unless every weight is finite after step `step` (every rank must call it)."""
        if not engine.weights_finite():
            raise self.diverged(step, "the drafter's weights hold NaN or infinite values")

    def diverged(self, step: int, why: str) -> TrainingDiverged:
        tags = complete_tags(self.checkpoint_dir)
        if not tags:
            resume = "no checkpoint was saved before it, so the same command starts again from step 0"
        else:
            newest = os.path.join(self.checkpoint_dir, tags[-1][1])
            resume = f"the newest checkpoint, {newest}, holds finite weights and the same command resumes from it"
        return TrainingDiverged(f"training diverged at step {step}: {why}. Nothing non-finite was saved: {resume} "
                                f"(if it diverges again, lower train.lr)")
