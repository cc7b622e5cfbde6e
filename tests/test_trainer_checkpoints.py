"""Checkpoints never lose work: a SIGKILLed run resumes to the same weights; incomplete tags are never picked."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash.models.drafter import DFlashDraftModel
from dflash.train.checkpoints import COMPLETE, LATEST, complete_tags, latest_tag
from dflash.train.step_metrics import expected_acceptance_length, layer_parameters, step_flops
from tests import trainer_harness
from tests.forked import process_context
from tests.test_trainer import held_rendezvous

# 6 samples, global batch 2: 3 steps per epoch, 4 epochs = 12 steps, a checkpoint after every step, 2 kept.
RUN = dict(micro_batch_size=2, grad_accum=1, epochs=4, save_every=1, keep_last=2)


def read_latest_step(checkpoints: str) -> int:
    try:
        with open(os.path.join(checkpoints, LATEST), encoding="utf-8") as f:
            return int(f.read().strip().removeprefix("step") or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.multiproc
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tmp_path, one_thread):
    full_losses, full_state = trainer_harness.run(str(tmp_path / "full"), **RUN)
    out = tmp_path / "killed"
    checkpoints = str(out / "checkpoints")
    # A fresh process forked from a server that imported the trainer once (tests/forked.py), ~0.3 s per step.
    process = process_context().Process(target=trainer_harness.main, args=(str(out), 2, 1, 2),
                                        kwargs=dict(epochs=4, save_every=1, keep_last=2, delay=0.15))
    process.start()
    try:
        deadline = time.monotonic() + 300
        while read_latest_step(checkpoints) < 3 and process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.join(timeout=60)
    assert process.exitcode == -signal.SIGKILL
    killed_at = read_latest_step(checkpoints)
    assert 3 <= killed_at < 12, f"the run was not killed mid-run (latest checkpoint step {killed_at})"

    resumed_losses, resumed_state = trainer_harness.run(str(out), **RUN)
    # Optimizer, scheduler, data position, anchors and RNG resume: the weights equal the uninterrupted run's.
    for name in full_state:
        torch.testing.assert_close(resumed_state[name], full_state[name], rtol=1e-6, atol=1e-7)
    assert resumed_losses[-1] == pytest.approx(full_losses[-1], rel=1e-6)
    with open(out / "metrics.jsonl", encoding="utf-8") as f:  # steps logged after the last checkpoint: once
        assert [json.loads(line)["step"] for line in f] == list(range(1, 13))
    assert [step for step, _ in complete_tags(checkpoints)] == [11, 12]  # keep-last-2
    folders = sorted(name for name in os.listdir(checkpoints) if os.path.isdir(os.path.join(checkpoints, name)))
    assert folders == ["step11", "step12"]  # the half-written tag of the killed run is gone too


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_resumes_to_the_same_weights(tmp_path, one_thread):
    """No periodic checkpoints at all: the one written on SIGTERM alone must make the resume exact."""
    run = dict(micro_batch_size=2, grad_accum=1, epochs=4)
    full_losses, full_state = trainer_harness.run(str(tmp_path / "full"), **run)
    out = tmp_path / "stopped"
    command = [sys.executable, "tests/trainer_harness.py", str(out), "2", "1", "2", "--epochs", "4",
               "--delay", "0.15"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    metrics = out / "metrics.jsonl"
    # The run meets itself in a store this test holds, listening already: a port handed to it could be taken by
    # another listener (the other xdist worker's) before its own store bound it.
    with held_rendezvous() as rendezvous:
        process = subprocess.Popen(command, env={**env, **rendezvous}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            while process.poll() is None and time.monotonic() < deadline and (
                    not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
    assert process.returncode not in (0, -signal.SIGTERM), stderr[-2000:]
    assert "TrainingStopped" in stderr
    stopped_at = read_latest_step(str(out / "checkpoints"))
    logged = len(metrics.read_text().splitlines())
    assert 3 <= stopped_at < 12 and stopped_at == logged  # the step in flight finished and was saved

    resumed_losses, resumed_state = trainer_harness.run(str(out), **run)
    for name in full_state:
        torch.testing.assert_close(resumed_state[name], full_state[name], rtol=1e-6, atol=1e-7)
    assert resumed_losses == pytest.approx(full_losses, rel=1e-6)


def test_an_incomplete_tag_is_never_picked(tmp_path):
    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / COMPLETE).write_text("4\n")
    (tmp_path / "step6").mkdir()  # half-written: no marker
    assert complete_tags(str(tmp_path)) == [(4, "step4")]
    assert latest_tag(str(tmp_path)) is None
    (tmp_path / LATEST).write_text("step4")
    assert latest_tag(str(tmp_path)) == "step4"
    (tmp_path / LATEST).write_text("step6")
    with pytest.raises(ValueError, match="step6"):
        latest_tag(str(tmp_path))


def test_expected_acceptance_length_and_flop_formula():
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_acceptance_length([0.0, 1.0]) == 1.0
    config = trainer_harness.drafter_config()
    drafter_layers = sum(p.numel() for name, p in DFlashDraftModel(config).named_parameters()
                         if name.startswith("layers."))
    assert layer_parameters(config) == drafter_layers
    queries, context = 64, 20
    kv = 2 * config.hidden_size * config.num_key_value_heads * config.head_dim
    expected = (6 * drafter_layers * queries + 4 * config.vocab_size * config.hidden_size * queries
                + 6 * (config.num_taps * config.hidden_size**2 + config.num_hidden_layers * kv) * context)
    assert step_flops(config, queries, context) == expected


def test_a_checkpoint_of_another_global_batch_is_refused(tmp_path, one_thread):
    """The data position is counted in global batches: a resume with another global batch size would train other
    samples, so it stops with the setting to change."""
    trainer_harness.run(str(tmp_path), micro_batch_size=2, grad_accum=1, epochs=1, save_every=1)
    with pytest.raises(ValueError, match="global batch of 2 samples, this run has 4 .*resume it with the ranks and "
                                         "settings it was trained with"):
        trainer_harness.run(str(tmp_path), micro_batch_size=2, grad_accum=2, epochs=2, save_every=1)


def test_another_global_batch_on_another_rank_count_is_refused_before_converting(tmp_path, monkeypatch):
    """Converting a tag to a universal checkpoint is costly at large shapes: a tag the run would refuse anyway (its
    global batch differs) is refused first."""
    import json
    import subprocess

    from dflash.train.checkpoints import COMPLETE, LATEST, LAYOUT, resume_tag

    (tmp_path / "step4").mkdir()
    (tmp_path / "step4" / LAYOUT).write_text(json.dumps({"world_size": 1, "zero_stage": 2, "global_batch_size": 2}))
    (tmp_path / "step4" / COMPLETE).write_text("4\n")
    (tmp_path / LATEST).write_text("step4")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("converted a tag it then refuses"))
    with pytest.raises(ValueError, match="step4 was trained on 1 rank\\(s\\) with a global batch of 2 samples, "
                                         "this run has 4"):
        resume_tag(str(tmp_path), world_size=2, rank=0, global_batch_size=4)
    assert resume_tag(str(tmp_path), world_size=1, rank=0, global_batch_size=2) == ("step4", False)


def test_the_resume_step_is_read_from_the_tag():
    from dflash.train.checkpoints import resume_step_of

    assert resume_step_of("ckpt", None) == 0 and resume_step_of("ckpt", "step12") == 12
    with pytest.raises(ValueError, match="does not name a step"):
        resume_step_of("ckpt", "step12_universal")


def test_a_kill_between_complete_and_latest_trains_no_step_twice(tmp_path, one_thread, monkeypatch):
    """A kill after step 5's `complete` and before `latest` names it: the resume starts at step 5, not step 4, and
    ends at the uninterrupted run's weights."""
    from dflash.train import checkpoints

    full_losses, full_state = trainer_harness.run(str(tmp_path / "full"), **RUN)
    out = tmp_path / "killed"
    real = checkpoints.write_text

    def killed_before_latest_of_step5(path, text):
        if os.path.basename(path) == LATEST and text == "step5":
            raise KeyboardInterrupt("killed")
        real(path, text)

    monkeypatch.setattr(checkpoints, "write_text", killed_before_latest_of_step5)
    with pytest.raises(KeyboardInterrupt):
        trainer_harness.run(str(out), **RUN)
    monkeypatch.setattr(checkpoints, "write_text", real)
    assert read_latest_step(str(out / "checkpoints")) == 4
    from dflash.train import checkpoint_policy

    saved = []
    real_save = checkpoint_policy.save_checkpoint
    monkeypatch.setattr(checkpoint_policy, "save_checkpoint",
                        lambda engine, directory, step, *args, **kwargs: saved.append(step)
                        or real_save(engine, directory, step, *args, **kwargs))
    resumed_losses, resumed_state = trainer_harness.run(str(out), **RUN)
    assert saved == list(range(6, 13))  # resumed after step 5
    for name in full_state:
        torch.testing.assert_close(resumed_state[name], full_state[name], rtol=1e-6, atol=1e-7)
    assert resumed_losses[-1] == pytest.approx(full_losses[-1], rel=1e-6)
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 13))
