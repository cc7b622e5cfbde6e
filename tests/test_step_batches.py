"""train.prepare_ahead: the next step's micro-batches made during the step's backward, before the optimizer step
(dflash/train/step_batches.py); the same training either way."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from dflash.config.schema import DeepSpeedSettings
from dflash.train import loop
from dflash.train.engine import TrainEngine, init_distributed
from dflash.train.metrics_log import MetricsLog
from dflash.train.step_batches import StepBatches
from tests import trainer_harness


def test_a_step_takes_what_was_made_ahead_for_it_and_only_that():
    made = []

    def make(step):
        made.append(step)
        return [{"step": step}, {"step": step}]

    batches = StepBatches(make, ahead=True)
    assert batches.of(0) == [{"step": 0}] * 2 and made == [0] and batches.pending == 0
    batches.make_ahead(1, total_steps=3)
    assert made == [0, 1] and batches.pending == 2
    assert batches.of(1)[0] == {"step": 1} and made == [0, 1] and batches.pending == 0  # not made again
    batches.make_ahead(3, total_steps=3)  # past the plan: nothing
    assert made == [0, 1] and batches.pending == 0
    batches.make_ahead(2, total_steps=3)
    assert batches.of(5)[0] == {"step": 5} and made == [0, 1, 2, 5] and batches.pending == 0  # another step: dropped
    off = StepBatches(make, ahead=False)
    off.make_ahead(1, total_steps=3)
    assert off.pending == 0 and made == [0, 1, 2, 5]


def harness_run(out_dir, monkeypatch, ahead: bool, events: list[str]) -> list[float]:
    """The harness drafter for 2 epochs (3 steps each); `events` gets "batch" for every micro-batch made and "update"
    for every optimizer step."""
    prepare, step = loop.prepare_micro_batch, TrainEngine.step

    def made(*args, **kwargs):
        events.append("batch")
        return prepare(*args, **kwargs)

    def updated(self):
        events.append("update")
        return step(self)

    init_distributed()
    log = MetricsLog(str(out_dir), enabled=True, tensorboard=False, wandb_mode="disabled", wandb_project="t",
                     config={})
    settings = dataclasses.replace(trainer_harness.settings(2, 1), prepare_ahead=ahead)
    with monkeypatch.context() as patched:
        patched.setattr(loop, "prepare_micro_batch", made)
        patched.setattr(TrainEngine, "step", updated)
        loop.train(settings, trainer_harness.drafter_config(), trainer_harness.synthetic_store(),
                   trainer_harness.frozen_head(), os.path.join(out_dir, "checkpoints"), log,
                   deepspeed=DeepSpeedSettings(zero_stage=2, bf16=False), rank=0, world_size=1,
                   device=torch.device("cpu"), show_progress=False)
    log.close()
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.slow
def test_the_next_batch_is_made_before_the_update_and_the_losses_are_the_same(tmp_path, monkeypatch):
    ahead, inline = [], []
    losses = harness_run(tmp_path / "ahead", monkeypatch, True, ahead)
    assert losses == harness_run(tmp_path / "inline", monkeypatch, False, inline)
    assert len(losses) == 6
    assert inline == ["batch", "update"] * 6
    # Step 1's batch before the loop's first step; then each step makes the next one before its update, the last
    # none.
    assert ahead == ["batch"] + ["batch", "update"] * 5 + ["update"]
