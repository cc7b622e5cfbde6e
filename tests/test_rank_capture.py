"""RankCapture: what trainer rank 0 announces to the capture ranks of `capture=online` (CPU, no processes)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from dflash.config import compose
from dflash.run_files import write_json
from dflash.stages.context import RunContext
from dflash.train import rank_capture
from dflash.train.rank_capture import RankCapture


def put_json(path, value: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(str(path), value)


@pytest.mark.parametrize("data_given", [True, False])
def test_a_moved_run_folder_streams_its_own_data(tmp_path, monkeypatch, data_given):
    """online.json of a run captured in `first` and moved to `moved` names `first/data`: the stream announced, and
    the feature cache's size, are those of `moved/data` (given, or by default the folder beside the features)."""
    first, moved = tmp_path / "first", tmp_path / "moved"
    put_json(first / "data" / "stats.json", {"num_tokens": 10**12})  # another run's data, far too big to cache
    put_json(moved / "data" / "stats.json", {"num_tokens": 100})
    put_json(moved / "features" / "online.json", {"data": str(first / "data"), "target_layer_ids": [1],
                                                  "num_samples": 8})
    put_json(moved / "features" / "target.json", {"hidden_size": 64})
    (moved / "checkpoints").mkdir()
    settings = RunContext(compose(["+experiment=tiny", "capture=online", "train.epochs=2", "capture.cache=auto",
                                   f"run_dir={moved}"])).settings
    announced = []
    link = SimpleNamespace(announce=announced.append, stream_start=lambda: announced[-1], captures=1)
    monkeypatch.setattr(rank_capture, "LinkedFeatureSource", lambda link, stream, *args: stream)
    data = {"data": str(moved / "data")} if data_given else {}
    RankCapture(link, settings.capture, str(moved / "features"), str(moved / "checkpoints"), str(moved),
                **data).source(settings.train, 0, 1, None)
    assert announced[0]["data"] == str(moved / "data")
    assert announced[0]["cache"]["cache"] and announced[0]["epochs"] == 1  # 100 tokens fit: the first epoch only
