"""No non-finite drafter, ever: non-finite steps are skipped a bounded number of times in a row, then
training stops naming the step and the newest checkpoint; non-finite weights are never saved."""

import json
import os

import pytest
import torch

from dflash.run_files import write_checksums
from dflash.train.checkpoints import LATEST, complete_tags
from dflash.train.divergence import TrainingDiverged
from tests import trainer_harness
from tests.test_heldout import run as train_run  # 6 samples, 2 a step: 3 steps an epoch, save_every=1 keeps all


class PoisonedStore(list):
    """Returns features full of NaN for the reads numbered `first` up to (not including) `last`, 2 reads a step."""

    def __init__(self, samples, first, last):
        super().__init__(samples)
        self.reads, self.first, self.last = 0, first, last

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        self.reads += 1
        if self.first < self.reads <= self.last:
            sample = {**sample, "hidden": torch.full_like(sample["hidden"], float("nan"))}
        return sample


def finite(state):
    return all(bool(torch.isfinite(t).all()) for t in state.values())


def test_a_few_non_finite_steps_are_skipped_with_a_warning_each(tmp_path, capsys):
    store = PoisonedStore(trainer_harness.synthetic_store(), 2, 8)  # steps 2, 3 and 4
    state, records = train_run(tmp_path, heldout=None, eval_every=0, save_every=1, store=store, epochs=4)
    losses = [r["loss"] for r in records]
    assert [step for step, loss in enumerate(losses, 1) if loss != loss] == [2, 3, 4]
    assert all(r["grad_norm"] == float("inf") for r in records[1:4])  # DeepSpeed skipped their updates
    err = capsys.readouterr().err
    assert "step 4: loss nan, grad_norm inf; its update was skipped (3 such step(s) in a row" in err
    assert len(records) == 12 and finite(state)
    # The LR follows the global step through the skipped updates, to the schedule's end, as a clean run's does.
    _, clean = train_run(tmp_path / "clean", heldout=None, eval_every=0, save_every=1, epochs=4)
    assert [r["lr"] for r in records] == [r["lr"] for r in clean]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_too_many_non_finite_steps_in_a_row_stop_naming_the_step_and_the_checkpoint(tmp_path, zero_stage):
    store = PoisonedStore(trainer_harness.synthetic_store(), 2, 10**6)  # every step from step 2 on
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(TrainingDiverged, match=rf"training diverged at step 11: 10 steps in a row had a "
                       rf"non-finite loss .*train.max_nonfinite_steps=10.*newest checkpoint, "
                       rf"{checkpoints / 'step10'}, holds finite weights"):
        train_run(tmp_path, heldout=None, eval_every=0, save_every=1, store=store, epochs=4, zero_stage=zero_stage)
    assert [tag for _, tag in complete_tags(str(checkpoints))] == [f"step{n}" for n in range(1, 11)]


def poison_optimizer_state(folder):
    """NaN in the first Adam moment of checkpoint `folder`, its checksums rewritten to match: a state no checksum
    catches, whose next update makes the weights NaN although that step's loss is finite."""
    name = next(n for n in os.listdir(folder) if n.endswith("optim_states.pt"))
    path = os.path.join(folder, name)
    saved = torch.load(path, weights_only=False)  # our own test checkpoint
    moments = saved["optimizer_state_dict"]["base_optimizer_state"]["state"]
    for state in moments.values():
        state["exp_avg"].fill_(float("nan"))
    torch.save(saved, path)
    os.remove(os.path.join(folder, "checksums.json"))
    write_checksums(folder)


def test_non_finite_weights_are_never_saved(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    train_run(tmp_path, heldout=None, eval_every=0, save_every=2, epochs=2)  # steps 2, 4 and 6 saved
    poison_optimizer_state(str(checkpoints / "step4"))
    os.replace(checkpoints / "step6", tmp_path / "step6")
    (checkpoints / LATEST).write_text("step4")
    with pytest.raises(TrainingDiverged, match=rf"at step 5: the drafter's weights hold NaN or infinite values.* "
                       rf"{checkpoints / 'step4'}, holds finite weights"):
        train_run(tmp_path, heldout=None, eval_every=0, save_every=1, epochs=2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 5 and records[-1]["loss"] == records[-1]["loss"]  # a finite loss
    assert [tag for _, tag in complete_tags(str(checkpoints))] == ["step2", "step4"]


def test_the_command_ends_with_one_line_and_exit_status_1(monkeypatch, capsys):
    from omegaconf import OmegaConf

    from dflash import pipeline

    def diverge(cfg):
        raise TrainingDiverged("training diverged at step 3: the drafter's weights hold NaN or infinite values")

    monkeypatch.setattr(pipeline, "run_role", diverge)
    with pytest.raises(SystemExit) as stopped:
        pipeline.run_command(OmegaConf.create({"run_dir": "unused"}))
    assert stopped.value.code == 1
    assert capsys.readouterr().err == ("dflash: error: training diverged at step 3: the drafter's weights hold NaN "
                                       "or infinite values\n")


def test_the_metrics_of_a_checkpoints_steps_reach_the_disk_before_it(tmp_path, monkeypatch):
    """A resume logs only the steps after its checkpoint: their records are fsynced before the checkpoint is saved,
    so a power loss cannot keep the checkpoint and lose them."""
    from dflash.train.checkpoint_policy import CheckpointPolicy
    from dflash.train.metrics_log import MetricsLog

    events, fsynced = [], []
    sync, save, fsync = MetricsLog.sync, CheckpointPolicy.save, os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: fsynced.append(fd) or fsync(fd))

    def synced(log):
        sync(log)
        events.append("sync" if fsynced and fsynced[-1] == log._file.fileno() else "not fsynced")

    monkeypatch.setattr(MetricsLog, "sync", synced)
    monkeypatch.setattr(CheckpointPolicy, "save", lambda self, *a, **k: events.append("save") or save(self, *a, **k))
    train_run(tmp_path, heldout=None, eval_every=0, save_every=2, epochs=2)
    assert events and events == ["sync", "save"] * (len(events) // 2)
