"""A torchrun job of capture=online that may restart (--max-restarts) records the error that ended a rank when a
restart would meet it again (dflash/stages/job_ending.py: ending_recorded), and a later start of the same job stops
at once with its status, before its ranks meet or the target loads (refuse_after_earlier_ending). The torchrun jobs
that show it whole are in tests/test_online_ranks.py."""

from __future__ import annotations

import json
import sys

import pytest

import dflash.extract.rank_link as rank_link
from dflash.config import ConfigError, compose
from dflash.pipeline import run_command
from dflash.stages.job_ending import ENDING_FILE, ending_recorded, this_command
from dflash.train.divergence import TrainingDiverged
from dflash.train.stop_signal import CaptureStopped, TrainingStopped


class Opened(Exception):
    """What the stand-in open_link raises: the start went on to meet the other ranks."""


@pytest.fixture
def job(monkeypatch):
    """This process as a rank of torchrun job `job-a` that may restart 3 times, in its first start; the link never
    opens (Opened)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")

    def open_link(*args, **kwargs):
        raise Opened()
    monkeypatch.setattr(rank_link, "open_link", open_link)
    return monkeypatch


def end_with(run_dir, error: BaseException) -> dict | None:
    with pytest.raises(type(error)), ending_recorded(str(run_dir), "trainer rank 0"):
        raise error
    path = run_dir / ENDING_FILE
    return json.loads(path.read_text()) if path.exists() else None


def online_train(run_dir) -> list[str]:
    return ["+experiment=tiny", "show_progress=false", "capture=online", f"run_dir={run_dir}", "stages=[train]"]


@pytest.mark.parametrize("error,status", [(ConfigError("train.lr=-1: expected > 0"), 2),
                                          (TrainingDiverged("non-finite loss at step 7"), 1)])
def test_a_restarted_start_after_a_user_error_or_divergence_stops_before_its_ranks_meet(tmp_path, job, capsys,
                                                                                       error, status):
    record = end_with(tmp_path, error)
    assert record == {"job": "job-a", "command": this_command(), "restart": 0, "rank": "trainer rank 0",
                      "status": status, "error": f"{type(error).__name__}: {error}"}
    job.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SystemExit) as ended:
        run_command(compose(online_train(tmp_path)))
    assert ended.value.code == status
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"dflash: error: an earlier start of this job (torchrun run job-a, restart 0) ended on trainer "
                    f"rank 0 with {type(error).__name__}: {error}; a restart would end the same way, so this one "
                    f"stops before any work (exit status {status}; recorded in {tmp_path / ENDING_FILE}: delete it "
                    f"to launch the same command under the same run id again)")


@pytest.mark.parametrize("error", [TrainingStopped(4, "SIGTERM"), CaptureStopped(1, "SIGTERM", "they ended the stream"),
                                   RuntimeError("the header of micro-batch 3 with capture rank 1 failed")])
def test_a_stop_or_a_lost_peer_is_not_recorded_and_the_restart_goes_on(tmp_path, job, error):
    """torchrun sends SIGTERM to the ranks left when it restarts the job after a rank died: their stop must not stop
    the restart. A peer that is gone is what a restart is for."""
    assert end_with(tmp_path, error) is None
    job.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(Opened):
        run_command(compose(online_train(tmp_path)))


@pytest.mark.parametrize("variable,value", [("TORCHELASTIC_RUN_ID", "job-b"), ("TORCHELASTIC_MAX_RESTARTS", "0")])
def test_another_launch_or_a_job_that_cannot_restart_is_not_stopped_by_a_record(tmp_path, job, variable, value):
    """Another launch has another run id (torchrun --standalone draws one; launch/multi_node.sh passes one); a job
    without restarts has none to save."""
    end_with(tmp_path, ConfigError("train.lr=-1: expected > 0"))
    job.setenv(variable, value)
    job.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(Opened):
        run_command(compose(online_train(tmp_path)))


def test_another_command_under_the_same_run_id_is_not_stopped_by_a_record(tmp_path, job, monkeypatch):
    """A fixed command launched again in one SLURM allocation (the same job id, so the same run id) is no restart."""
    end_with(tmp_path, ConfigError("holds a drafter trained with other settings"))
    monkeypatch.setattr("sys.argv", [*sys.argv, "overwrite=true"])
    job.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(Opened):
        run_command(compose(online_train(tmp_path)))


def test_a_job_whose_launch_names_no_run_id_records_nothing(tmp_path, job):
    """torchrun's default run id "none" is every such launch's: a record under it would stop the next one."""
    job.setenv("TORCHELASTIC_RUN_ID", "none")
    assert end_with(tmp_path, ConfigError("train.lr=-1: expected > 0")) is None
