"""The training loop's side of the time budget (train.max_minutes): the times it feeds the plan, agreed across ranks.

A TimeBudget (dflash/train/time_budget.py) does the arithmetic on times it is given; this feeds it the seconds since
the training loop was entered after each step and each held-out evaluation, and leaves out of its step rate what
will not recur: the steps under train.profile_steps and the writing of the profiler's table. Every time is the
largest over the ranks (one small all-reduce), so every rank plans, stops and saves the same step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from dflash.config.schema import TrainSettings
from dflash.train.time_budget import TimeBudget


def agreed_seconds(seconds: float, device: torch.device) -> float:
    """`seconds` as measured on this rank, the largest over all ranks, so every rank plans the same steps."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        seconds = value.item()
    return seconds


class BudgetPace:
    """The time budget of `settings.max_minutes` fed by the loop (`budget`; None without one: every call a no-op).

    total_steps: the epochs / max_steps total; evaluates: whether the loop runs held-out evaluations; saved: the
    budget's state in the checkpoint resumed; entered: the loop's clock when training was entered.
    """

    def __init__(self, settings: TrainSettings, total_steps: int, *, evaluates: bool, saved: dict[str, Any] | None,
                 entered: float, device: torch.device, clock: Callable[[], float]) -> None:
        self.budget: TimeBudget | None = None
        if settings.max_minutes is not None:
            self.budget = TimeBudget(settings.max_minutes, total_steps, eval_every=settings.eval_every,
                                     evaluates=evaluates, save_every=settings.save_every, saved=saved,
                                     decay_ratio=settings.decay_ratio)
        self.entered, self.device, self.clock = entered, device, clock

    def resumed_plan(self, total_steps: int) -> bool:
        """Whether the plan differs from `total_steps` before any step: a resumed run goes on with its saved plan."""
        return self.budget is not None and self.budget.planned_steps != total_steps

    def after_step(self, step: int, started: float, profiled: bool) -> bool:
        """Step `step`, begun at `started`, has ended; True when the plan was set or changed."""
        if self.budget is None:
            return False
        if profiled:  # slower under the profiler than the steps to come: out of the step rate
            self.budget.exclude(agreed_seconds(self.clock() - started, self.device))
        run_s = agreed_seconds(self.clock() - self.entered, self.device)
        return self.budget.after_step(step, run_s, profiled=profiled)

    def after_evaluation(self, step: int) -> bool:
        """The held-out evaluation of step `step` has ended; True when the plan changed."""
        if self.budget is None:
            return False
        return self.budget.after_evaluation(step, agreed_seconds(self.clock() - self.entered, self.device))

    @contextlib.contextmanager
    def left_out(self, profiled: bool) -> Iterator[None]:
        """Time spent inside is left out of the step rate when `profiled` (the profiler writing its table)."""
        started = self.clock()
        yield
        if self.budget is not None and profiled:  # ranks agree on the seconds, so their plans stay equal
            self.budget.exclude(agreed_seconds(self.clock() - started, self.device))
