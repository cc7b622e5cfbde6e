"""What a command runs around the pipeline (dflash.pipeline.run_command, run_role): which processes open the rank
link of capture=online, and the error that ends a command, kept in the run folder's log as the console shows it."""

from __future__ import annotations

import glob
import os
import signal
import sys
import time

import pytest

from dflash.config import compose
from dflash.pipeline import Pipeline, run_command, run_role
from dflash.stages.command_ending import TerminationLine
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


@pytest.mark.parametrize("device,gpus,expected", [
    ("cuda", 0, "dflash: error: device=cuda: this machine has no CUDA device (torch "),
    ("cuda:0", 0, "dflash: error: device=cuda:0: this machine has no CUDA device (torch "),
    ("cuda:2", 2, "dflash: error: device=cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
])
def test_a_cuda_device_the_machine_lacks_is_refused_before_any_work(tmp_path, monkeypatch, capsys, device, gpus,
                                                                   expected):
    import torch

    single_process(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as ended:
        run_command(compose([*TINY, f"device={device}", "stages=[data,capture]", f"run_dir={run_dir}"]))
    assert ended.value.code == 2
    assert capsys.readouterr().err.startswith(expected)
    assert not run_dir.exists()  # nothing written, not even the run folder


@pytest.mark.parametrize("typed,warned", [([], False), (["drafter.num_taps=4"], True)])
def test_only_an_ignored_setting_the_command_line_set_is_warned_about(tmp_path, typed, warned):
    """The tiny experiment sets drafter.num_taps=2; naming the taps makes it unused, which is worth a warning only
    when someone typed it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "dflash.train", "+experiment=tiny", f"run_dir={tmp_path}",
                           "drafter.target_layer_ids=[1]", *typed, "stages=[data]", "data.limit=2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HYDRA_FULL_ERROR": ""})
    assert done.returncode == 0, done.stderr
    assert ("dflash: warning: drafter.num_taps=4 is ignored: drafter.target_layer_ids names the taps"
            in done.stderr) == warned
    assert "num_taps=2" not in done.stderr


def test_ctrl_c_ends_a_command_with_one_line_that_the_run_log_keeps(tmp_path, monkeypatch, capsys):
    single_process(monkeypatch)

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(DataStage, "run", interrupted)
    monkeypatch.setattr("dflash.pipeline.exit_command", lambda status: sys.exit(status))  # not SIGINT to pytest
    with pytest.raises(SystemExit) as ended:
        run_command(compose([*TINY, f"run_dir={tmp_path}"]), ["data"])
    assert ended.value.code == 130
    line = "dflash: interrupted (Ctrl-C): rerun the same command to resume; finished stages are kept, and so is " \
           "what the stage in progress had saved"
    assert capsys.readouterr().err.splitlines()[-1] == line
    assert run_log_text(tmp_path).splitlines()[-1] == line


def test_sigterm_outside_training_ends_a_command_with_one_line_and_status_143(tmp_path, monkeypatch, capsys):
    """SIGTERM (`timeout`, a scheduler) during the data stage or an evaluation ended the command without a word;
    training's own stop (a checkpoint, then TrainingStopped) is unchanged."""
    single_process(monkeypatch)
    seen = []

    def terminated(self):
        seen.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises first

    monkeypatch.setattr(DataStage, "run", terminated)
    with pytest.raises(SystemExit) as ended:
        run_command(compose([*TINY, f"run_dir={tmp_path}"]), ["data"])
    assert ended.value.code == 143 and seen[0] is not signal.SIG_DFL
    line = "dflash: interrupted (SIGTERM): rerun the same command to resume; finished stages are kept, and so is " \
           "what the stage in progress had saved"
    assert capsys.readouterr().err.splitlines()[-1] == line
    assert run_log_text(tmp_path).splitlines()[-1] == line
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back once the command ended
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of a job: a handler would keep it waiting in a collective
    with TerminationLine():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.delenv("WORLD_SIZE")
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a handler set before (a launcher's) is left alone
    try:
        with TerminationLine():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)

