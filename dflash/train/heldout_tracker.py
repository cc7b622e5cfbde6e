"""Held-out acceptance during training: when it is due, the figures it adds to the step's record, the best checkpoint.

Every `eval_every` steps and at the last step, rank 0 replays the current weights over the held-out set
(dflash/train/heldout.py) and the record gets heldout/*; weights whose `best_by` figure beats the best so far (a
tie does not) replace checkpoint_dir/best (dflash/train/best_checkpoint.py). best_by (train.best_by) is "tau", the
greedy replay's tau, or "tau_T<x>", the expected tau at temperature x (which the evaluation then adds to the
record). The replay draws no random numbers, so it changes
nothing in training; the loop runs it before the step's checkpoint, so a resumed run has seen every evaluation it
restores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dflash.config.schema import best_by_temperature
from dflash.models.drafter import DFlashDraftModel
from dflash.models.drafter_config import DrafterConfig
from dflash.train.best_checkpoint import clear_best, read_best, write_best
from dflash.train.engine import TrainEngine
from dflash.train.heldout import HeldoutSet, estimate_key

logger = logging.getLogger(__name__)


def check_heldout(heldout: HeldoutSet | None, eval_every: int, drafter_config: DrafterConfig,
                  best_by: str = "tau") -> None:
    """ValueError unless the held-out settings fit the drafter: eval_every and a best_by at a temperature need a
    set, the set the drafter's taps (and the target's final states for the estimate)."""
    if heldout is None and eval_every:
        raise ValueError(f"eval_every={eval_every} needs a held-out set (data.heldout > 0)")
    if heldout is None and best_by != "tau":
        raise ValueError(f"best_by={best_by} needs a held-out set (data.heldout > 0)")
    if heldout is not None:
        heldout.check(drafter_config, best_by_temperature(best_by))


def evaluate_heldout(engine: TrainEngine, heldout: HeldoutSet, frozen_head: tuple[torch.Tensor, torch.Tensor],
                     rank: int, temperature: float = 0.0) -> tuple[dict[str, float] | None,
                                                                   dict[str, torch.Tensor] | None]:
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
        return heldout.evaluate(drafter.to(engine.device), frozen_head, temperature), state
    if rank != 0:
        return None, None
    return heldout.evaluate(engine.module, frozen_head, temperature), None


class HeldoutTracker:
    """The held-out evaluations of one training call and the best so far by `best_by` (rank 0); without a set,
    never due.

    A call that starts from scratch deletes a best left in checkpoint_dir by an earlier run (it is not this run's);
    a resumed call reads its best back, so it never replaces a better best with a worse one. A best measured after
    the step it resumes at (`resumed_at`: a kill lost the steps after the last checkpoint) is of weights this call
    trains again: it is kept until the next evaluation, which replaces it whatever its figure, so the best is
    always weights of the run's own line. clock: the loop's.
    """

    def __init__(self, heldout: HeldoutSet | None, eval_every: int, checkpoint_dir: str,
                 frozen_head: tuple[torch.Tensor, torch.Tensor], *, resumed: bool, rank: int, world_size: int,
                 clock: Callable[[], float], best_by: str = "tau", resumed_at: int | None = None) -> None:
        self.heldout, self.eval_every = heldout, eval_every
        self.temperature = best_by_temperature(best_by)
        self.best_by = "tau" if not self.temperature else estimate_key(self.temperature)
        self.checkpoint_dir, self.frozen_head = checkpoint_dir, frozen_head
        self.rank, self.world_size, self.clock = rank, world_size, clock
        self.best: dict[str, Any] | None = None
        if rank == 0:
            if resumed:
                self.best = read_best(checkpoint_dir)
                if self.best is not None and resumed_at is not None and self.best["step"] > resumed_at:
                    logger.info(f"[train] the best checkpoint (step {self.best['step']}) was measured after step "
                                f"{resumed_at}, where training resumes: the next held-out evaluation replaces it")
                    self.best = None
            else:
                clear_best(checkpoint_dir)

    def due(self, step: int, last_step: int) -> bool:
        return self.heldout is not None and (
            step == last_step or bool(self.eval_every and step % self.eval_every == 0))

    def run(self, engine: TrainEngine, step: int) -> dict[str, float]:
        """Replay the current weights and keep them when their best_by figure is the best so far; the step
        record's heldout/* figures (on other ranks only heldout/seconds, the time they waited). Every rank must
        call it."""
        started = self.clock()
        held, gathered = evaluate_heldout(engine, self.heldout, self.frozen_head, self.rank, self.temperature)
        figures = {}
        if held is not None:
            figures.update({f"heldout/{key}": value for key, value in held.items()})
            if self._better(held):
                self.best = {"step": step, "tau": held["tau"], "acceptance_rate": held["acceptance_rate"]}
                if self.best_by != "tau":
                    self.best.update({"best_by": self.best_by, self.best_by: held[self.best_by]})
                weights = gathered if gathered is not None else engine.consolidated_state_dict()
                write_best(self.checkpoint_dir, weights, self.best)
        if self.world_size > 1:
            dist.barrier()
        figures["heldout/seconds"] = self.clock() - started
        return figures

    def _better(self, held: dict[str, float]) -> bool:
        """Whether `held` beats the best so far by best_by (a best kept under another figure is beaten at once)."""
        if self.best is None or self.best_by not in self.best:
            return True
        return held[self.best_by] > self.best[self.best_by]
