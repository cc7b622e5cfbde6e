"""The metrics record of each training step, and which steps' records are written.

A step's record: its loss and accuracies (train_step), then lr (the LR of the next step: the scheduler has stepped),
epoch, tflops, mfu (with a peak), grad_norm, heldout/* at an evaluation, planned_steps under a time budget, and on
the steps that are written, step_s and tokens_per_s: the training seconds per step and tokens per second since the
previous written record, held-out evaluations left out. Each written record reports its own window, so the first
steps' compilation weighs only on the first one. Written: every log_every steps, the last step and every evaluated
step (docs/training.md, "Logs").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dflash.train.engine import TrainEngine
from dflash.train.metrics_log import MetricsLog

logger = logging.getLogger(__name__)


class StartupPhases:
    """The seconds each timed start-up phase of a training call took, in the order they ran: the "ready" line shows
    them, so that a slow start on a fresh machine says where it went."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.entered, self.seconds = clock, clock(), {}

    def timed(self, phase: str, function: Callable[..., Any], *args: Any) -> Any:
        """function(*args), its seconds counted as `phase`'s."""
        started = self.clock()
        result = function(*args)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + self.clock() - started
        return result

    def describe(self, until: float) -> str:
        """'engine 24.0 s, checkpoint 0.1 s, other 5.2 s': the phases, then the rest of the time from the call's
        entry until `until`."""
        parts = [f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items()]
        other = until - self.entered - sum(self.seconds.values())
        return ", ".join(parts + [f"other {max(0.0, other):.1f} s"])


class StepRecords:
    """The records of one training call, from `first_step` (the step it resumed at; 0 from scratch) on.

    peak_tflops: per rank, for mfu (None: no mfu); budgeted: a time budget plans the steps; startup: the call's
    start-up phases, from its entry; announce: print where the start-up time went (rank 0).
    """

    def __init__(self, log: MetricsLog, engine: TrainEngine, *, first_step: int, log_every: int, steps_per_epoch: int,
                 peak_tflops: float | None, world_size: int, budgeted: bool, startup: StartupPhases,
                 announce: bool, clock: Callable[[], float]) -> None:
        self.log, self.engine, self.clock = log, engine, clock
        self.first_step, self.log_every, self.steps_per_epoch = first_step, log_every, steps_per_epoch
        self.peak_tflops, self.world_size, self.budgeted = peak_tflops, world_size, budgeted
        self.startup, self.announce = startup, announce
        self.window_started, self.window_step, self.window_eval_s, self.window_tokens = clock(), first_step, 0.0, 0.0

    def add_step(self, metrics: dict[str, float], step: int, started: float) -> None:
        """Step `step`, begun at `started`, has ended: its tokens and FLOPs become the record's throughput figures."""
        now = self.clock()
        if step == self.first_step + 1 and self.announce:
            # Where a (re)start spends its time: engine build + checkpoint load, then the first step's kernel
            # compilation (flex attention), both paid again by every resumed call.
            logger.info(f"[train] ready after {started - self.startup.entered:.1f} s "
                        f"({self.startup.describe(started)}); first step {now - started:.1f} s")
        self.window_tokens += metrics.pop("tokens")
        tflops = metrics.pop("flops") / (now - started) / 1e12
        epoch, step_in_epoch = divmod(step - 1, self.steps_per_epoch)
        metrics.update(lr=self.engine.lr(), epoch=epoch + step_in_epoch / self.steps_per_epoch, tflops=tflops)
        if self.peak_tflops is not None:
            metrics["mfu"] = tflops / (self.peak_tflops * self.world_size)
        grad_norm = self.engine.grad_norm()
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm

    def write(self, step: int, metrics: dict[str, float], total_steps: int) -> None:
        """Complete step `step`'s record and write it when due; total_steps: the total planned now."""
        if self.budgeted:
            metrics.update(lr=self.engine.lr(), planned_steps=total_steps)  # the LR after any change of plan
        evaluated = "heldout/seconds" in metrics
        if evaluated:
            self.window_eval_s += metrics["heldout/seconds"]  # kept out of step_s and tokens/s
        if step % self.log_every == 0 or step == total_steps or evaluated:
            now = self.clock()
            training_s = now - self.window_started - self.window_eval_s
            metrics["step_s"] = training_s / (step - self.window_step)
            metrics["tokens_per_s"] = self.window_tokens / training_s
            self.window_started, self.window_step, self.window_eval_s, self.window_tokens = now, step, 0.0, 0.0
            self.log.log(step, metrics)
