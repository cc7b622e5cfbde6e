"""The train stage's side of online capture: spool sessions, the cache's disk room and its tie to the checkpoints."""

from __future__ import annotations

import functools
import json
import os
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from dflash.config import compose
from dflash.extract import feature_cache
from dflash.extract.feature_cache import DISK_MARGIN_FRACTION, cache_room, cached_epochs
from dflash.train.capture_split import split_advice
from dflash.train.feature_cache_choice import choose_feature_cache
from dflash.train.online_capture import OnlineCapture
from dflash.run_files import CHECKPOINT_KEY, make_owned_dir, read_json, write_json

Usage = namedtuple("Usage", "total used free")
SETTINGS = SimpleNamespace(micro_batch_size=2, grad_accum=1, seed=0, group_by_length=0, epochs=2, num_anchors=4)


def put_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, value)


def test_the_cache_leaves_room_for_a_spool_on_its_disk_and_a_margin(tmp_path, monkeypatch):
    total, free, spool_budget = 1000 * 2**20, 600 * 2**20, 300 * 2**20
    monkeypatch.setattr(feature_cache.shutil, "disk_usage", lambda path: Usage(total, total - free, free))
    (tmp_path / "cache").mkdir()
    (tmp_path / "spool").mkdir()
    room = cache_room(str(tmp_path / "cache"), str(tmp_path / "spool"), spool_budget)
    assert room == free - int(DISK_MARGIN_FRACTION * total) - spool_budget
    assert cached_epochs("auto", 400 * 2**20, None, free) and not cached_epochs("auto", 400 * 2**20, None, room)
    assert cache_room(str(tmp_path / "cache"), str(tmp_path / "spool"), 10 * total) == 0
    if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:
        # A spool on another file system takes nothing from the cache's disk.
        assert cache_room(str(tmp_path / "cache"), "/dev/shm", spool_budget) == room + spool_budget


def test_a_resumed_run_uses_only_the_cache_decision_made_for_its_checkpoints(tmp_path):
    run_dir, log_dir = tmp_path / "run", tmp_path / "run" / "capture_logs"
    dirs = {"checkpoints": str(run_dir / "checkpoints")}
    capture = OnlineCapture(None, str(run_dir), dirs, torch.device("cpu"), lambda: None)
    assert capture.checkpoint_key is None
    put_json(os.path.join(dirs["checkpoints"], CHECKPOINT_KEY), {"fingerprint": "aaaa"})
    assert capture.checkpoint_key == "aaaa"
    assert OnlineCapture(None, str(run_dir), dirs, torch.device("cpu"), lambda: None, "bbbb").checkpoint_key == "bbbb"
    kept = tmp_path / "kept"
    make_owned_dir(str(kept))
    put_json(str(log_dir / "cache.json"), {"cache": True, "dir": str(kept), "checkpoint": "aaaa"})
    resume = functools.partial(choose_feature_cache, SimpleNamespace(cache_dir=None), run_dir=str(run_dir), info={},
                               hidden_size=64, epochs=3, resume_step=3)
    assert resume(checkpoint_key="aaaa") == {"cache": True, "dir": str(kept), "checkpoint": "aaaa"}
    # Checkpoints of other settings restored: the recorded cache is another run's, not read and not kept.
    fresh = {"cache": False, "dir": str(run_dir / "feature_cache"), "checkpoint": "bbbb"}
    assert resume(checkpoint_key="bbbb") == fresh and not kept.exists()
    assert json.loads((log_dir / "cache.json").read_text()) == fresh  # what the next restart reads
    put_json(str(log_dir / "cache.json"), {"cache": True, "dir": str(kept)})  # recorded before the fingerprint
    assert resume(checkpoint_key="aaaa")["cache"] is False


def test_one_epoch_keeps_no_cache_whatever_capture_cache_says(tmp_path):
    """Nothing would read a one-epoch cache back: off, without estimating or touching the disk (capture.cache=true
    with an epoch too large for the disk is no error either)."""
    settings = SimpleNamespace(cache="true", cache_dir=None, cache_budget_bytes=1, dtype="bfloat16")
    decided = choose_feature_cache(settings, run_dir=str(tmp_path), info={}, hidden_size=64, epochs=1,
                                   checkpoint_key="aaaa", resume_step=0)
    assert decided == {"cache": False, "dir": str(tmp_path / "feature_cache"), "checkpoint": "aaaa"}
    assert not (tmp_path / "feature_cache").exists()
    assert read_json(str(tmp_path / "capture_logs" / "cache.json")) == decided


def online_capture(tmp_path, *overrides: str) -> OnlineCapture:
    """An OnlineCapture of the tiny recipe over hand-made stage outputs (no data or capture stage is run)."""
    run_dir = tmp_path / "run"
    dirs = {name: str(run_dir / name) for name in ("data", "features", "checkpoints")}
    put_json(os.path.join(dirs["features"], "online.json"),
               {"num_samples": 6, "data": dirs["data"], "target_layer_ids": [1, 3]})
    put_json(os.path.join(dirs["features"], "target.json"), {"hidden_size": 64})
    put_json(os.path.join(dirs["data"], "stats.json"), {"num_tokens": 100})
    put_json(os.path.join(dirs["checkpoints"], CHECKPOINT_KEY), {"fingerprint": "aaaa"})
    cfg = compose(["+experiment=tiny", "capture=online", f"run_dir={run_dir}", *overrides])
    return OnlineCapture(cfg, str(run_dir), dirs, torch.device("cpu"), lambda: None)


def test_an_external_start_streams_through_a_new_session_and_leaves_the_earlier_ones(tmp_path):
    capture = online_capture(tmp_path, "capture.workers=external", "capture.num_workers=2")
    earlier = os.path.join(capture.spool_dir, "session-earlier", "data", "w0")
    os.makedirs(earlier)
    open(os.path.join(earlier, "i000000000003.safetensors"), "wb").close()  # its workers may still write
    source = capture.source(SETTINGS, 0, 1, [])
    spool = read_json(os.path.join(capture.run_dir, "capture_logs", "spec.json"))["spool"]
    assert os.path.dirname(spool) == capture.spool_dir and os.path.basename(spool).startswith("session-")
    assert str(source.spool.path) == spool
    assert os.listdir(earlier) == ["i000000000003.safetensors"]
    decided = read_json(os.path.join(capture.run_dir, "capture_logs", "cache.json"))
    assert decided["checkpoint"] == "aaaa"


def test_an_external_spool_folder_of_someone_elses_files_is_refused(tmp_path):
    foreign = tmp_path / "elsewhere"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not dflash's\n")
    capture = online_capture(tmp_path, "capture.workers=external", "capture.num_workers=2",
                             f"capture.spool_dir={foreign}")
    with pytest.raises(ValueError, match="did not write"):
        capture.source(SETTINGS, 0, 1, [])
    assert (foreign / "notes.txt").is_file()


@pytest.mark.parametrize("capture_rate,trainer_rate,devices,split", [
    (1000.0, 500.0, (2, 6), [3, 5]),   # capture twice as fast per device: a third of the devices capture
    (100.0, 900.0, (4, 4), [7, 1]),    # a slow target: every device but one trainer captures
    (900.0, 100.0, (1, 1), [1, 1]),    # at least one of each
])
def test_the_balanced_split_evens_out_the_two_rates(capture_rate, trainer_rate, devices, split):
    report = split_advice(capture_rate, trainer_rate, *devices)
    assert report["balanced_split"] == split and sum(split) == sum(devices)
    assert report["balanced_capture_fraction"] == pytest.approx(trainer_rate / (capture_rate + trainer_rate))
