"""Held-out acceptance during training: when it is due, the figures it adds to the step's record, the best checkpoint.

Every `eval_every` steps and at the last step, rank 0 replays the current weights over the held-out set
(dflash/train/heldout.py) and the record gets heldout/*; weights whose tau beats the best so far (a tie does not)
replace checkpoint_dir/best (dflash/train/best_checkpoint.py). The replay draws no random numbers, so it changes
nothing in training; the loop runs it before the step's checkpoint, so a resumed run has seen every evaluation it
restores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.train.best_checkpoint import clear_best, read_best, write_best
from dflash.train.engine import TrainEngine
from dflash.train.heldout import HeldoutSet


def check_heldout(heldout: HeldoutSet | None, eval_every: int, drafter_config: DrafterConfig) -> None:
    """ValueError unless the held-out settings fit the drafter: eval_every needs a set, the set the drafter's taps."""
    if heldout is None and eval_every:
        raise ValueError(f"eval_every={eval_every} needs a held-out set (data.heldout > 0)")
    if heldout is not None:
        heldout.check(drafter_config)


def evaluate_heldout(engine: TrainEngine, heldout: HeldoutSet, frozen_head: tuple[torch.Tensor, torch.Tensor],
                     rank: int) -> tuple[dict[str, float] | None, dict[str, torch.Tensor] | None]:
    """Rank 0: (held-out metrics of the current weights, their consolidated state if it was gathered); elsewhere
    (None, None). Collective under ZeRO-3, so every rank must call it."""
    if engine.zero_stage == 3:
        # ZeRO-3 forward hooks gather and re-shard parameters collectively, so rank 0 alone cannot run the
        # trained module: every rank joins the consolidation and rank 0 replays a plain copy.
        state = engine.consolidated_state_dict()
        if rank != 0:
            return None, None
        with torch.device("meta"):  # no initialisation: draws nothing from the RNG that training uses
            drafter = DFlashDraftModel(engine.config)
        drafter.load_state_dict(state, assign=True)
        return heldout.evaluate(drafter.to(engine.device), frozen_head), state
    if rank != 0:
        return None, None
    return heldout.evaluate(engine.module, frozen_head), None


class HeldoutTracker:
    """The held-out evaluations of one training call and the best tau so far (rank 0); without a set, never due.

    A call that starts from scratch deletes a best left in checkpoint_dir by an earlier run (it is not this run's);
    a resumed call reads its best back, so it never replaces a better best with a worse one. clock: the loop's.
    """

    def __init__(self, heldout: HeldoutSet | None, eval_every: int, checkpoint_dir: str,
                 frozen_head: tuple[torch.Tensor, torch.Tensor], *, resumed: bool, rank: int, world_size: int,
                 clock: Callable[[], float]) -> None:
        self.heldout, self.eval_every = heldout, eval_every
        self.checkpoint_dir, self.frozen_head = checkpoint_dir, frozen_head
        self.rank, self.world_size, self.clock = rank, world_size, clock
        self.best: dict[str, Any] | None = None
        if rank == 0:
            if resumed:
                self.best = read_best(checkpoint_dir)
            else:
                clear_best(checkpoint_dir)

    def due(self, step: int, last_step: int) -> bool:
        return self.heldout is not None and (
            step == last_step or bool(self.eval_every and step % self.eval_every == 0))

    def run(self, engine: TrainEngine, step: int) -> dict[str, float]:
        """Replay the current weights and keep them when their tau is the best so far; the step record's heldout/*
        figures (on other ranks only heldout/seconds, the time they waited). Every rank must call it."""
        started = self.clock()
        held, gathered = evaluate_heldout(engine, self.heldout, self.frozen_head, self.rank)
        figures = {}
        if held is not None:
            figures.update({f"heldout/{key}": value for key, value in held.items()})
            if self.best is None or held["tau"] > self.best["tau"]:
                self.best = {"step": step, "tau": held["tau"], "acceptance_rate": held["acceptance_rate"]}
                weights = gathered if gathered is not None else engine.consolidated_state_dict()
                write_best(self.checkpoint_dir, weights, self.best)
        if self.world_size > 1:
            dist.barrier()
        figures["heldout/seconds"] = self.clock() - started
        return figures
