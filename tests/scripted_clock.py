"""Real tiny training runs on a scripted clock: each step and each held-out evaluation "takes" a set time."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest
import torch

from dflash.train import loop
from dflash.train.metrics_log import MetricsLog
from tests import trainer_harness


class ScriptedClock:
    """The loop's clock: time moves only when a step or an evaluation "takes" its scripted seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowHeldout:
    """A held-out set whose evaluation takes `seconds` on the scripted clock."""

    def __init__(self, clock: ScriptedClock, seconds: float) -> None:
        self.clock, self.seconds, self.steps = clock, seconds, 0

    def check(self, config, temperature: float = 0.0) -> None:
        pass

    def evaluate(self, drafter, frozen_head, temperature: float = 0.0) -> dict[str, float]:
        self.clock.now += self.seconds
        self.steps += 1
        return {"tau": 1.0, "acceptance_rate": 0.0}


def scripted_steps(monkeypatch, clock: ScriptedClock, seconds, sigterm_at: int | None = None) -> None:
    """Step k (1-based, counted in this run) takes seconds(k); with sigterm_at, a SIGTERM arrives during that
    step."""
    train_step = loop.train_step
    calls = [0]

    def timed(*args, **kwargs):
        calls[0] += 1
        clock.now += seconds(calls[0])
        if calls[0] == sigterm_at:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                pytest.fail("the loop's SIGTERM handler is not installed")
            signal.raise_signal(signal.SIGTERM)
        return train_step(*args, **kwargs)

    monkeypatch.setattr(loop, "clock", clock)
    monkeypatch.setattr(loop, "train_step", timed)


def budget_run(out, minutes: float | None, *, epochs: int = 20, heldout=None, eval_every: int = 0,
               log_every: int = 1, profile_steps: str | None = None) -> list[dict]:
    """The harness drafter (global batch 2, 3 steps per epoch) under a budget; rank 0's metric records."""
    from dflash.train.engine import init_distributed

    init_distributed()
    settings = dataclasses.replace(trainer_harness.settings(2, 1, epochs=epochs), max_minutes=minutes,
                                   eval_every=eval_every, log_every=log_every, profile_steps=profile_steps)
    log = MetricsLog(str(out), enabled=True, tensorboard=False, wandb_mode="disabled", wandb_project="t", config={})
    try:
        loop.train(settings, trainer_harness.drafter_config(), trainer_harness.synthetic_store(),
                   trainer_harness.frozen_head(), str(out / "checkpoints"), log, rank=0, world_size=1,
                   device=torch.device("cpu"), show_progress=False, heldout=heldout)
    finally:
        log.close()
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]
