"""When the training loop saves a checkpoint, what the checkpoint's client state holds, and what a resume checks.

The data position, the anchors and the LR all follow from the global step, so the client state holds that step, the
global batch size it was counted in, the time budget's state under train.max_minutes (dflash/train/time_budget.py),
and the samples the plan batches apart after the first epoch (BatchPlan.kept, chosen when the run starts from what
its feature source keeps): the later epochs' order depends on it. The files themselves are
dflash/train/checkpoints.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from dflash.config.schema import TrainSettings
from dflash.data.batch_plan import BatchPlan
from dflash.data.feature_source import FeatureSource
from dflash.train.checkpoints import batch_mismatch, load_checkpoint, save_checkpoint
from dflash.train.engine import TrainEngine
from dflash.train.time_budget import TimeBudget

logger = logging.getLogger(__name__)


class CheckpointPolicy:
    """Saves at every settings.save_every-th step (0: never), at the last step and when a stop signal was received
    (then every rank saves, also in the last step: the caller asked to stop now, not after export and eval), keeping
    the newest settings.keep_last complete tags (0: all)."""

    def __init__(self, checkpoint_dir: str, settings: TrainSettings, global_batch_size: int, rank: int) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.save_every, self.keep_last = settings.save_every, settings.keep_last
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.kept = 0  # BatchPlan.kept of the run (kept_apart)

    def restore(self, engine: TrainEngine, tag: str | None) -> dict[str, Any]:
        """Load `tag` into the engine (weights, optimizer, LR and RNG state) and return its client state; without a
        tag, the state of step 0. A checkpoint counted in another global batch size is refused: its data position
        would not match."""
        if tag is None:
            return {"global_step": 0}
        state = load_checkpoint(engine, self.checkpoint_dir, tag, rank=self.rank)
        saved_batch = state.get("global_batch_size", self.global_batch_size)
        if saved_batch != self.global_batch_size:
            raise batch_mismatch(tag, saved_batch, self.global_batch_size)
        if self.rank == 0:
            logger.info(f"[train] resuming from the checkpoint of step {state['global_step']:,} "
                        f"({os.path.join(self.checkpoint_dir, tag)}): weights, optimizer, data position")
        return state

    def kept_apart(self, plan: BatchPlan, source: FeatureSource, state: dict[str, Any]) -> BatchPlan:
        """`plan` with the samples `source` keeps apart for the later epochs (BatchPlan.kept): chosen at the run's
        start, and on a resume the number its start chose (0 for a run saved before there was one), whatever the
        resumed source could keep, so every epoch keeps its order across a restart. Only a run on one rank chooses
        one (colocated capture keeps no memory on more), so the ranks of a resumed run agree on it."""
        saved = None if state["global_step"] == 0 else int(state.get("kept_samples", 0))
        chosen = source.kept_apart(plan.epoch_order(0), saved)  # the source keeps them (resumed: if it can)
        self.kept = chosen if saved is None else saved
        if self.kept and self.rank == 0:
            logger.info(f"[train] {self.kept:,} of {plan.num_samples:,} samples kept apart: the later epochs batch "
                        f"them on their own{' (as the run chose at its start)' if saved is not None else ''}")
        return dataclasses.replace(plan, kept=self.kept) if self.kept != plan.kept else plan

    def due(self, step: int, last_step: int, stopping: bool) -> bool:
        """Whether step `step` is saved (the ranks agree on `stopping` and `last_step`)."""
        return stopping or step == last_step or bool(self.save_every and step % self.save_every == 0)

    def save(self, engine: TrainEngine, step: int, budget: TimeBudget | None) -> None:
        """Save step `step` on every rank."""
        client_state = {"global_step": step, "global_batch_size": self.global_batch_size}
        if budget is not None:
            client_state["time_budget"] = budget.state()
        if self.kept:
            client_state["kept_samples"] = self.kept
        save_checkpoint(engine, self.checkpoint_dir, step, client_state, rank=self.rank, keep_last=self.keep_last)
