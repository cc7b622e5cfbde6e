"""What a command runs around the pipeline (dflash.pipeline.run_command, run_role): which processes open the rank
link of capture=online, and the error that ends a command, kept in the run folder's log as the console shows it."""

from __future__ import annotations

import glob
import os

import pytest

from dflash.config import compose
from dflash.pipeline import Pipeline, run_command, run_role
from dflash.stages.data import DataStage

TINY = ["+experiment=tiny", "show_progress=false"]


def single_process(monkeypatch) -> None:
    """This test process as a command started without a launcher (no torchrun variables)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)


def run_log_text(run_dir) -> str:
    (log,) = glob.glob(os.path.join(str(run_dir), "logs", "*.log"))
    with open(log, encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("stages", [["data"], ["capture"], ["data", "capture"], ["export"], ["eval"]])
def test_an_online_command_without_training_runs_the_pipeline_in_one_process(tmp_path, monkeypatch, stages):
    # One process runs these steps of launch/one_node.sh (and the eval command a run's closing block suggests):
    # only training streams from capture ranks.
    single_process(monkeypatch)
    monkeypatch.setattr(Pipeline, "run", lambda self: {"ran": self.settings.stages})
    cfg = compose([*TINY, "capture=online", f"run_dir={tmp_path}", f"stages=[{','.join(stages)}]"])
    assert run_role(cfg) == {"ran": stages}


def test_the_data_step_of_an_online_run_is_not_refused(tmp_path, monkeypatch):
    single_process(monkeypatch)
    run_command(compose([*TINY, "capture=online", f"run_dir={tmp_path}", "stages=[data]"]))
    assert os.path.exists(tmp_path / "data" / "done.json")


def test_a_user_error_that_ends_a_command_is_in_the_run_log(tmp_path, monkeypatch, capsys):
    single_process(monkeypatch)
    (tmp_path / "checkpoints").mkdir()  # a run folder without a drafter to evaluate
    with pytest.raises(SystemExit) as ended:
        run_command(compose([*TINY, f"run_dir={tmp_path}"]), ["eval"])
    assert ended.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("dflash: error: no drafter of these settings to evaluate")
    assert run_log_text(tmp_path).splitlines()[-1] == line  # once, as the console showed it


def test_an_unexpected_error_leaves_its_traceback_in_the_run_log(tmp_path, monkeypatch):
    single_process(monkeypatch)

    def fail(self):
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(DataStage, "run", fail)
    with pytest.raises(RuntimeError):
        run_command(compose([*TINY, f"run_dir={tmp_path}"]), ["data"])
    log = run_log_text(tmp_path)
    assert "Traceback (most recent call last)" in log and log.endswith("RuntimeError: the disk went away\n")
