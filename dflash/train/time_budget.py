"""A wall-time budget for the training stage (`train.max_minutes`): the LR schedule ends within it.

Sizing `train.max_steps` from an assumed step time fails when the real step is slower (measured on one H200: 0.36 s
instead of the assumed 0.15 s, so the deadline stopped training with the LR at 55% of its peak). Here the trainer
times its own steps and plans the total it can afford:

    planned = min(cap, done + the most steps that, with the held-out evaluations they bring, fit the time left)

cap is the epochs / max_steps total, and never fewer than done + 1 are planned. The first step of a run (engine
warm-up, kernel compilation) is not timed. Nor are up to ONE_OFFS later steps that took more than ONE_OFF_FACTOR times
the median of the other steps of the rate window, with an excess that would move a full window's rate by more than
REPLAN_TOLERANCE: recompilations. On an H200 the recipe's second step took 12-17 s against 0.17 s for the next ones,
and a recompilation for a new shape at step 74 took 27 s; timed, that one step cut the plan to a third of the steps it
could afford, and kept it below three quarters until it left the 400-step window. Their excess over the median still
counts against the budget, as spent (and the hard stop below takes the last step as timed). A slow step beyond the
first ONE_OFFS is the pace and is timed, and so is a smaller one (noise must not use up the slots) and the step that
carries a checkpoint save (a recurring cost). Each step is judged against the window's other steps as it ends; a run's
first timed steps wait until ONE_OFF_BASELINE others are there. Steps under the profiler (their time exclude()d by the
caller) are no samples of the pace: neither judged nor counted among the rate's steps. The first plan comes after
CALIBRATION_STEPS timed steps, or sooner when the judged steps already used CALIBRATION_SHARE of the budget. Then the
plan is renewed every REPLAN_EVERY steps and after every held-out evaluation, from the rate of the last rate_window
steps (evaluations excluded), so a run that slows down still anneals in time; a renewed plan replaces the current one
only when the totals differ by more than REPLAN_TOLERANCE of the steps the LR decays over (all of them under
warmup-cosine, the last train.decay_ratio of them under warmup-stable-decay, where the decay is that much steeper),
so the LR does not jerk at every renewal, and the hard stop ends a plan at most that far from its LR minimum.
Evaluations cost the seconds of the shortest one measured; before any was measured, UNMEASURED_EVAL_SHARE of the
budget is set aside for all of them. A hard stop ends training at the current step (its final evaluation and
checkpoint as usual) when the next step and the final evaluation no longer fit.

Times come from the caller (seconds since the start of this run's training loop), so the arithmetic runs without a
clock; the loop passes times agreed across ranks, so every rank plans the same steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

CALIBRATION_STEPS = 20         # steps timed after a run's first step before the first plan
CALIBRATION_SHARE = 0.05       # ... or fewer, once the timed steps used this share of the budget
ONE_OFF_FACTOR = 3.0           # a step this many times the others' median is a one-off (a recompilation)
ONE_OFFS = 3                   # one-off steps per run left out of the step rate; later slow steps are the pace
ONE_OFF_BASELINE = 5           # a step is judged against the median of at least this many other steps
REPLAN_EVERY = 20              # steps between renewals of the plan
RATE_WINDOW = 100              # the recent step rate is measured over at least this many steps (rate_window)
REPLAN_TOLERANCE = 0.02        # a renewed plan replaces the current total when they differ by more than this share
SHOWN_CHANGE = 0.05            # a changed plan gets a console line when it moved this share from the last one shown
UNMEASURED_EVAL_SHARE = 0.05   # share of the budget set aside for the evaluations to come before one is measured


def check_max_minutes(value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"max_minutes must be a finite number of minutes > 0, or None for no time budget; "
                         f"got {value}")


def evaluations_in(first: int, last: int, eval_every: int) -> int:
    """The held-out evaluations at steps first..last when `last` is the final step: every eval_every-th step
    (0: none) and the final step."""
    if first > last:
        return 0
    if not eval_every:
        return 1
    periodic = last // eval_every - (first - 1) // eval_every
    return periodic + (0 if last % eval_every == 0 else 1)


def rate_window(save_every: int) -> int:
    """Steps the step rate is measured over: RATE_WINDOW, rounded up to whole intervals of save_every (0: none)."""
    if save_every <= 0:
        return RATE_WINDOW
    return save_every * math.ceil(RATE_WINDOW / save_every)


def affordable_total(cap: int, done: int, remaining_s: float, step_s: float,
                     evaluations_s: Callable[[int], float]) -> int:
    """The largest total in done + 1 .. cap whose steps after `done`, plus evaluations_s(total) (the seconds of the
    evaluations still to come when training ends at total), fit in remaining_s; done + 1 when none fits."""
    def fits(total: int) -> bool:
        return (total - done) * step_s + evaluations_s(total) <= remaining_s

    low, high = done + 1, max(cap, done + 1)
    if not fits(low):
        return low
    while low < high:  # the cost grows with the total: the largest total that fits, by bisection
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


class TimeBudget:
    """The planned total of steps under a budget of `minutes`, renewed from the steps and evaluations timed.

    cap: the epochs / max_steps total; eval_every, evaluates: when the loop runs held-out evaluations (`evaluates`
    False: none at all); save_every: the checkpoint interval (the rate window spans whole intervals); saved:
    `state()` of the checkpoint resumed; decay_ratio: the share of the steps the LR decays over (train.decay_ratio;
    1, warmup-cosine), which scales REPLAN_TOLERANCE.
    """

    def __init__(self, minutes: float, cap: int, *, eval_every: int, evaluates: bool,
                 save_every: int = 0, saved: dict[str, Any] | None = None, decay_ratio: float = 1.0) -> None:
        check_max_minutes(minutes)
        self.minutes = minutes
        self.budget_s = 60.0 * minutes
        self.cap = cap
        self.eval_every = eval_every
        self.evaluates = evaluates
        self.save_every = save_every
        self.tolerance = REPLAN_TOLERANCE * decay_ratio  # a share of the planned total
        saved = saved or {}
        self.spent_before_s = float(saved.get("spent_s", 0.0))  # by the earlier calls of a resumed run
        self.planned_steps = min(cap, int(saved.get("planned_steps", cap)))
        self.eval_s: float | None = saved.get("eval_s")  # the shortest evaluation's seconds, None before any
        self.settled = bool(saved)  # a plan that the LR already followed: renewals then keep REPLAN_TOLERANCE
        self.elapsed_s = self.spent_before_s  # under the budget, at the latest time given
        self.step_s: float | None = None  # the rate behind the current plan
        self.stopped = False  # the hard stop ended the plan early
        self._run_s = 0.0  # the latest time given, this run
        self._evaluations_s = 0.0  # seconds of this run left out of the step rate: evaluations, exclude(), one-offs
        # (step, training seconds) of the latest steps; the window spans whole checkpoint intervals, so it always
        # holds the same share of checkpoint saves and their cost is spread evenly (not in one window out of four)
        self._marks: deque[tuple[int, float]] = deque(maxlen=rate_window(save_every) + 1)
        self._first_mark: tuple[int, float] | None = None
        self._last_step_s = 0.0
        self._next_plan: int | None = None  # the step of the next renewal, once calibrated
        self._one_offs_left = ONE_OFFS
        self._judged_step = 0  # the steps up to this one were judged one-off or not
        self._unsampled: set[int] = set()  # profiled steps: their time is excluded, they are no sample of the pace
        self.shown_steps: int | None = None  # the plan of the last console line (line())

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` already spent (a profiled step, the profiler's table) out of the step rate, as evaluations
        are: they still count against the budget, but the steps to come will not take that long."""
        self._evaluations_s += seconds

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run goes on with the budget that is left."""
        return {"planned_steps": self.planned_steps, "spent_s": self.elapsed_s, "eval_s": self.eval_s}

    def after_step(self, step: int, run_s: float, profiled: bool = False) -> bool:
        """Step `step` ended `run_s` seconds after this run's start: time it, renew the plan when due, stop when the
        next step and the evaluations left would not fit. True when the plan was set or changed (worth a line).
        profiled: the step ran under the profiler and the caller exclude()d its time; it is no sample of the pace,
        so it is neither judged nor counted among the rate's steps."""
        self._advance(run_s)
        mark = (step, run_s - self._evaluations_s)
        # As timed, one-off or not: the hard stop must not bet on the next step being fast again (a sudden,
        # lasting slowdown looks like a one-off at its first step).
        self._last_step_s = mark[1] - self._marks[-1][1] if self._marks else 0.0
        self._marks.append(mark)
        if profiled:
            self._unsampled.add(step)
        if self._first_mark is None:  # this run's first step: start-up and compilation, not timed
            self._first_mark = mark
            self._judged_step = step
        else:
            self._leave_out_one_offs()
            if self._next_plan is None:
                (first_step, first_s), (last_step, last_s) = self._marks[0], self._marks[-1]
                judged = self._judged_step == last_step  # an unjudged slow step must not end the calibration
                if last_step - first_step >= CALIBRATION_STEPS or (
                        judged and last_s - first_s >= CALIBRATION_SHARE * self.budget_s):
                    self._next_plan = step
        news = False
        if self._next_plan is not None and step >= self._next_plan:
            news = self._renew(step, pending_from=step)  # this step's own evaluation, if any, is still to come
            self._next_plan = step + REPLAN_EVERY
        return self._stop_if_out_of_time(step, pending_from=step) or news

    def after_evaluation(self, step: int, run_s: float) -> bool:
        """The held-out evaluation of step `step` ended at `run_s`: its time is the cost of the next ones; the plan is
        renewed (and may stop here). True when the plan changed."""
        seconds = run_s - self._run_s
        self._evaluations_s += seconds
        # The shortest one measured: the first evaluation of a run also compiles its kernels.
        self.eval_s = seconds if self.eval_s is None else min(self.eval_s, seconds)
        self._advance(run_s)
        if step >= self.planned_steps:
            return False
        news = self._next_plan is not None and self._renew(step, pending_from=step + 1)
        return self._stop_if_out_of_time(step, pending_from=step + 1) or news

    def line(self, previous: int) -> str | None:
        """The console line for a plan that was set or changed from `previous` steps, or None when it moved less than
        SHOWN_CHANGE from the last plan shown (every plan is in metrics.jsonl's planned_steps): the first plan, a
        resumed plan and the stop always get one."""
        shown = self.shown_steps
        if shown is not None and self.step_s is not None and not self.stopped and \
                abs(self.planned_steps - shown) < SHOWN_CHANGE * shown:
            return None
        self.shown_steps = self.planned_steps
        return self.describe(previous if shown is None else shown)

    def describe(self, previous: int) -> str:
        """The line printed when the plan changed from `previous` steps."""
        head = f"[train] time budget {self.minutes:g} min:"
        if self.stopped:
            return (f"{head} {self.elapsed_s / 60:.1f} min spent, stopping after step {self.planned_steps:,} "
                    f"(was {previous:,})")
        if self.step_s is None:
            return (f"{head} resuming the plan of {self.planned_steps:,} steps (was {previous:,}), "
                    f"{(self.budget_s - self.elapsed_s) / 60:.1f} min left")
        return f"{head} {self.step_s:.3f} s/step -> {self.planned_steps:,} steps (was {previous:,})"

    def _advance(self, run_s: float) -> None:
        self._run_s = run_s
        self.elapsed_s = self.spent_before_s + run_s

    def _leave_out_one_offs(self) -> None:
        """Judge the window's steps not judged yet, oldest first, each against the median of the window's other
        steps once ONE_OFF_BASELINE of them are there: a step over ONE_OFF_FACTOR times that median is a one-off
        (while ONE_OFFS last) unless it carries a checkpoint save. A one-off's excess over the median leaves the
        step rate for good: the window's marks from that step on, and the marks to come, are shifted back by it."""
        marks = list(self._marks)
        if self._one_offs_left == 0:  # every later step is the pace
            self._judged_step = marks[-1][0]
            return
        seconds = {b[0]: b[1] - a[1] for a, b in zip(marks, marks[1:]) if b[0] not in self._unsampled}
        if len(seconds) <= ONE_OFF_BASELINE:
            return
        for step in sorted(s for s in seconds if s > self._judged_step):
            self._judged_step = step
            # The save after step - 1 is timed in this step. With save_every 1 every step carries one: then the
            # median carries it too, and steps are judged as usual.
            carries_save = self.save_every > 1 and (step - 1) % self.save_every == 0
            if self._one_offs_left == 0 or carries_save:
                continue
            others = sorted(value for other, value in seconds.items() if other != step)
            median = others[len(others) // 2]
            excess = seconds[step] - median
            # Worth a slot only when it is far above the others and, timed, it would move a full window's rate by
            # more than REPLAN_TOLERANCE; a smaller one stays in the rate (noise must not use up the slots).
            window_steps = self._marks.maxlen - 1
            if seconds[step] <= ONE_OFF_FACTOR * median or excess <= REPLAN_TOLERANCE * median * window_steps:
                continue
            seconds[step] = median
            self._one_offs_left -= 1
            self._evaluations_s += excess
            self._marks = deque(((s, t - excess if s >= step else t) for s, t in self._marks),
                                maxlen=self._marks.maxlen)

    def _recent_step_s(self) -> float:
        (first_step, first_s), (last_step, last_s) = self._marks[0], self._marks[-1]
        steps = last_step - first_step - sum(1 for s in self._unsampled if first_step < s <= last_step)
        return (last_s - first_s) / steps if steps > 0 else 0.0

    def _evaluation_cost(self, count: int) -> float:
        if count == 0 or not self.evaluates:
            return 0.0
        if self.eval_s is None:
            return UNMEASURED_EVAL_SHARE * self.budget_s
        return count * self.eval_s

    def _renew(self, step: int, pending_from: int) -> bool:
        step_s = self._recent_step_s()
        proposed = affordable_total(
            self.cap, step, self.budget_s - self.elapsed_s, step_s,
            lambda total: self._evaluation_cost(evaluations_in(pending_from, total, self.eval_every)),
        )
        if self.settled and abs(proposed - self.planned_steps) <= self.tolerance * self.planned_steps:
            return False
        self.planned_steps, self.step_s, self.settled = proposed, step_s, True
        return True

    def _stop_if_out_of_time(self, step: int, pending_from: int) -> bool:
        """End the plan at `step` when one more step (at the slower of the recent rate and the last step) and the
        evaluations it would bring no longer fit."""
        if step >= self.planned_steps:
            return False
        next_step_s = max(self._recent_step_s(), self._last_step_s)
        needed = next_step_s + self._evaluation_cost(evaluations_in(pending_from, step + 1, self.eval_every))
        if self.budget_s - self.elapsed_s >= needed:
            return False
        self.planned_steps, self.stopped = step, True
        return True
