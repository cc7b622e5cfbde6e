"""The capture worker pool's process handling: GPU masks, and workers that outlive the training they fed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dflash.extract.online_workers import WorkerPool


def test_worker_gpus_are_read_through_the_launchers_own_mask(tmp_path, monkeypatch):
    # A scheduler that gave this process GPUs 4-7 shows them as 0-3; the workers must land on 4-7, not 0-3.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    pool = WorkerPool(str(tmp_path / "spec.json"), 2, str(tmp_path), devices=[0, 1, 2, 3], gpus_per_worker=2)
    assert [pool.visible_devices(w) for w in range(2)] == ["4,5", "6,7"]
    with pytest.raises(ValueError, match=r"capture devices \[5\] are not among the 4 GPU\(s\)"):
        WorkerPool(str(tmp_path / "spec.json"), 1, str(tmp_path), devices=[5]).visible_devices(0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert pool.visible_devices(1) == "2,3"


def test_a_worker_still_running_after_training_is_stopped_not_an_error(tmp_path, capsys):
    pool = WorkerPool(str(tmp_path / "spec.json"), 1, str(tmp_path))
    # Stands in for a restarted worker still loading its target when training has read every item.
    pool.processes[0] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    began = time.monotonic()
    pool.join(timeout_s=0.5)
    assert pool.processes[0].poll() is not None and time.monotonic() - began < 30
    assert "still ran" in capsys.readouterr().out
