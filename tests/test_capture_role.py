"""A capture rank of capture=online (dflash/stages/capture_role.py): the error that ends it is in its own log; a stop
signal ends it only once its trainers stopped, with their exit status."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

import dflash.pipeline as pipeline
from dflash.config import compose
from dflash.stages import capture_role
from dflash.stages.capture_role import serve_capture
from dflash.train.stop_signal import CaptureStopped


def test_the_error_that_ends_a_capture_rank_is_in_its_log(tmp_path):
    def stream_start():
        raise RuntimeError("trainer rank 0 went away")

    link = SimpleNamespace(rank=1, devices=["cpu"], stream_start=stream_start)
    cfg = compose(["+experiment=tiny", "show_progress=false", "capture=online", f"run_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="went away"):
        serve_capture(cfg, link)
    [log] = (tmp_path / "logs").glob("*-capture-rank1.log")
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: trainer rank 0 went away" in text


def stream_ending_with(monkeypatch, tmp_path, signalled: bool):
    """serve_capture of a capture rank whose stream fails as when its trainers are gone, after a SIGTERM to this
    process (caught: the stream runs under the rank's stop-signal handler) or without one."""
    def send_stream(context, link, target, start):
        if signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("the credit of micro-batch 9 with trainer rank 0 failed (rank 0 is gone?)")
    monkeypatch.setattr(capture_role, "_send_stream", send_stream)
    monkeypatch.setattr(capture_role.RunContext, "target", None)
    link = SimpleNamespace(rank=1, devices=["cpu"], stream_start=lambda: {"first_step": 0})
    cfg = compose(["+experiment=tiny", "show_progress=false", "capture=online", f"run_dir={tmp_path}"])
    serve_capture(cfg, link)


def test_a_capture_rank_whose_trainers_leave_after_a_stop_signal_ends_stopped(tmp_path, monkeypatch):
    """The trainers stop on the same signal, save their step and close the connections: the rank ends in
    CaptureStopped (exit status 143 as theirs, dflash/pipeline.py), with one line in its log."""
    with pytest.raises(CaptureStopped, match="capture rank 1 stopped by SIGTERM once the trainer ranks had stopped"):
        stream_ending_with(monkeypatch, tmp_path, signalled=True)
    [log] = (tmp_path / "logs").glob("*-capture-rank1.log")
    assert log.read_text().splitlines()[-1].startswith("[online] capture rank 1 stopped by SIGTERM")
    with pytest.raises(RuntimeError, match="rank 0 is gone"):  # without a signal it is the error it was
        stream_ending_with(monkeypatch, tmp_path, signalled=False)


def test_a_stopped_capture_rank_exits_143_as_its_trainers_do(tmp_path, monkeypatch, capsys):
    def run_role(cfg):
        raise CaptureStopped(1, "SIGTERM", "they ended the stream")
    monkeypatch.setattr(pipeline, "run_role", run_role)
    with pytest.raises(SystemExit) as ended:
        pipeline.run_command(compose(["+experiment=tiny", "capture=online", f"run_dir={tmp_path}"]))
    assert ended.value.code == 128 + 15
    assert capsys.readouterr().out.startswith("[online] capture rank 1 stopped by SIGTERM")
