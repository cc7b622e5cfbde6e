"""How each error ends a command (dflash/stages/command_ending.py): its line or traceback and its exit status."""

from __future__ import annotations

import pytest

from dflash.config import ConfigError
from dflash.config.errors import CorruptFile
from dflash.stages.command_ending import STOPPED, ending, ending_status
from dflash.train.divergence import TrainingDiverged
from dflash.train.stop_signal import CaptureStopped, TrainingStopped


@pytest.mark.parametrize("error,line,status", [
    (TrainingStopped(7, "SIGTERM"), f"[train] {TrainingStopped(7, 'SIGTERM')}\n", STOPPED),
    (CaptureStopped(2, "SIGTERM", "they said so"), f"[online] {CaptureStopped(2, 'SIGTERM', 'they said so')}\n",
     STOPPED),
    (ConfigError("train.lr=-1: must be > 0"), "dflash: error: train.lr=-1: must be > 0\n", 2),
    (CorruptFile("a.safetensors is corrupt"), "dflash: error: a.safetensors is corrupt\n", 2),  # a subclass
    (TrainingDiverged("loss is nan"), "dflash: error: loss is nan\n", 1),
    (TrainingStopped(7, "SIGINT"), f"[train] {TrainingStopped(7, 'SIGINT')}\n", 130),  # Ctrl-C, step saved
    (TrainingStopped(7, "SIGUSR1"), f"[train] {TrainingStopped(7, 'SIGUSR1')}\n", STOPPED),
    (TrainingStopped(7, "a signal on another rank"), f"[train] {TrainingStopped(7, 'a signal on another rank')}\n",
     STOPPED),
    (KeyboardInterrupt(), "dflash: interrupted (Ctrl-C): rerun the same command to resume; finished stages are kept, "
                          "and so is what the stage in progress had saved\n", 130),
])
def test_known_errors_end_in_one_line_with_their_status(error, line, status, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert (ending(error), ending_status(error)) == (line, status)


def test_full_error_shows_a_user_error_s_traceback_and_other_errors_always_do(monkeypatch):
    def raised(error):
        try:
            raise error
        except BaseException as caught:
            return caught

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    user = raised(ConfigError("bad key"))
    assert ending(user).startswith("Traceback") and ending(user).endswith("ConfigError: bad key\n")
    assert ending_status(user) == 2
    assert ending(TrainingStopped(3, "SIGUSR1")).startswith("[train] training stopped")  # a stop: never a traceback
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    other = raised(KeyError("x"))
    assert ending(other).startswith("Traceback") and ending_status(other) is None


@pytest.mark.parametrize("status,returncode", [(130, -2), (143, 143), (2, 2)])
def test_a_command_ended_by_ctrl_c_dies_of_sigint(status, returncode):
    """A shell loop or `cmd1; cmd2` stops after a child that died of SIGINT, and goes on after one that exited 130."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from dflash.stages.command_ending import exit_command; "
                           f"print('line', flush=True); exit_command({status})"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == returncode and done.stdout == "line\n"


def test_ctrl_c_s_ending_off_the_main_thread_exits_with_130():
    """Only the main thread may set SIGINT's handler: elsewhere the command exits with the status instead."""
    import threading

    from dflash.stages.command_ending import exit_command

    ended = []

    def end():
        try:
            exit_command(130)
        except SystemExit as stop:
            ended.append(stop.code)

    thread = threading.Thread(target=end)
    thread.start()
    thread.join()
    assert ended == [130]
