"""The training engine's forward and step leave the device alone (dflash/train/engine.py): DeepSpeed's throughput
timer, which waits for the device from a hook on the module, is off."""

from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator

from dflash.config.schema import DeepSpeedSettings
from dflash.models.drafter import DFlashDraftModel
from dflash.train.engine import TrainEngine, init_distributed
from tests import trainer_harness


def test_no_device_wait_in_the_module_s_forward_or_the_step(monkeypatch):
    _, world_size, _ = init_distributed()
    drafter = DFlashDraftModel(trainer_harness.drafter_config())
    drafter.init_weights(0)
    settings = trainer_harness.settings(micro_batch_size=1, grad_accum=1)
    engine = TrainEngine(drafter, settings, DeepSpeedSettings(zero_stage=2), total_steps=8, world_size=world_size,
                         bf16=False)
    waits = []
    monkeypatch.setattr(get_accelerator(), "synchronize", lambda *args: waits.append(args))
    config, device = engine.config, engine.device  # DeepSpeed moves the module to the machine's accelerator
    for _ in range(4):  # DeepSpeed's timer starts waiting at its third step
        hidden = engine.module(torch.arange(7, device=device)[None],
                               torch.randn(1, 4, config.hidden_size, device=device),
                               target_hidden=torch.randn(1, 3, config.num_taps * config.hidden_size, device=device))
        engine.backward(hidden.float().square().mean())
        engine.step()
    assert waits == []
