"""A step with a non-finite loss or gradient norm stops training, named, before its weights are checkpointed; in
bf16 DeepSpeed's per-gradient overflow check (a host wait per step) is off, as the loop checks instead."""

from __future__ import annotations

import math

import pytest

from dflash.train import loop
from dflash.train.checkpoints import latest_tag
from dflash.train.engine import bf16_section
from dflash.train.metrics_log import MetricsLog
from tests import trainer_harness


def test_bf16_turns_deepspeeds_overflow_check_off_and_fp32_has_none():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config

    assert bf16_section(False) == {"enabled": False}
    section = bf16_section(True)
    assert section["enabled"] is True
    assert section.get("check_grad_overflow", False) is False
    # The block is one DeepSpeed accepts, and with the check off.
    assert DeepSpeedBF16Config(**section).check_grad_overflow is False


@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (math.inf, 1.0), (2.0, -1.0), (2.0, math.nan)])
def test_a_non_finite_loss_or_norm_is_refused_naming_the_step(loss, grad_norm):
    with pytest.raises(FloatingPointError, match="training step 7"):
        loop.finite_or_raise(7, loss, grad_norm)


def test_finite_figures_pass():
    loop.finite_or_raise(7, 2.0, 0.5)
    loop.finite_or_raise(7, 2.0, None)  # ZeRO runs that compute no norm


def test_a_run_stops_at_the_broken_step_and_keeps_the_checkpoints_before_it(tmp_path, monkeypatch):
    from dflash.train.engine import init_distributed

    init_distributed()
    real_metrics = loop.step_metrics
    calls = []

    def breaks_at_step_5(*args, **kwargs):
        metrics = real_metrics(*args, **kwargs)
        calls.append(1)
        if len(calls) == 5:
            metrics["loss"] = math.nan
        return metrics

    monkeypatch.setattr(loop, "step_metrics", breaks_at_step_5)
    log = MetricsLog(str(tmp_path), enabled=True, tensorboard=False, wandb_mode="disabled", wandb_project="t",
                     config={})
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(FloatingPointError, match="training step 5"):
        loop.train(trainer_harness.settings(2, 1, epochs=4, save_every=2), trainer_harness.drafter_config(),
                   trainer_harness.synthetic_store(), trainer_harness.frozen_head(), str(checkpoints), log, rank=0,
                   world_size=1, device=loop.torch.device("cpu"), show_progress=False)
    log.close()
    assert latest_tag(str(checkpoints)) == "step4"  # nothing of step 5 was saved
