"""A run folder moved after its capture stage trains on its own data, not on the folder it was captured in
(`capture=colocated`, CPU, tiny)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dflash.config import compose
from dflash.pipeline import Pipeline
from dflash.run_files import read_json, write_json
from tests.test_colocated import STORED_CURVE, TINY, losses


def captured_and_moved(first: Path, moved: Path) -> Path:
    """The data and capture stages run in `first`, then the folder moved to `moved`; its colocated.json names
    `first/data`, as captures once wrote it. That record."""
    Pipeline(compose(TINY + [f"run_dir={first}", "capture=colocated", "stages=[data,capture]"])).run()
    shutil.move(first, moved)
    record = moved / "features" / "colocated.json"
    write_json(str(record), {**read_json(str(record)), "data": str(first / "data")})
    return record


def test_a_moved_run_folder_trains_on_its_own_data(tmp_path):
    """`first` then holds another, smaller data set. The moved run's capture is up to date (its fingerprint names no
    folder): training reads `moved/data`, the tiny run's own losses."""
    first, moved = tmp_path / "first", tmp_path / "moved"
    record = captured_and_moved(first, moved)
    Pipeline(compose(TINY + [f"run_dir={first}", "capture=colocated", "data.limit=16", "stages=[data]"])).run()

    Pipeline(compose(TINY + [f"run_dir={moved}", "capture=colocated", "stages=[capture,train]"])).run()
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    torch.testing.assert_close(torch.tensor(losses(moved)), torch.tensor(stored), rtol=2e-4, atol=2e-4)
    assert read_json(str(record))["data"] == str(first / "data")  # the capture was not run again


def test_a_moved_run_folder_whose_old_folder_is_gone_still_trains(tmp_path):
    first, moved = tmp_path / "first", tmp_path / "moved"
    captured_and_moved(first, moved)
    assert not first.exists()

    Pipeline(compose(TINY + [f"run_dir={moved}", "capture=colocated", "stages=[capture,train]"])).run()
    assert losses(moved)
