"""A capture redone under new settings moves the old feature store aside (going back restores it); settings that
only regroup the same samples redo nothing."""

from __future__ import annotations

import os

import pytest

from dflash.config import compose
from dflash.pipeline import Pipeline
from dflash.run_files import read_json

TINY = ["+experiment=tiny", "show_progress=false", "stages=[data,capture]"]


def must_not_run(*args, **kwargs):
    raise AssertionError("the capture ran again")


def test_changed_capture_settings_move_the_store_aside_and_back(tmp_path, monkeypatch):
    run = [f"run_dir={tmp_path}"]
    features = tmp_path / "features"
    first = Pipeline(compose(TINY + run))
    first.run()
    first_key = read_json(str(features / "done.json"))["fingerprint"]
    with monkeypatch.context() as patch:  # batch and shard sizes only regroup the same samples
        patch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
        Pipeline(compose(TINY + run + ["capture.batch_tokens=4096", "capture.shard_tokens=65536"])).run()

    # Stored in bfloat16 instead of float32: other features, so the stage is redone, the old store kept aside.
    changed = Pipeline(compose(TINY + run + ["capture.dtype=bfloat16"]))
    changed.run()
    assert read_json(str(features / "done.json"))["fingerprint"] == changed.capture_fingerprint() != first_key
    assert read_json(str(features / "manifest.json"))["dtype"] == "bfloat16"
    aside = tmp_path / f"features.{first_key}"
    assert read_json(str(aside / "done.json"))["fingerprint"] == first_key

    with monkeypatch.context() as patch:  # back to the first settings: their store is restored, not recaptured
        patch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
        Pipeline(compose(TINY + run)).run()
    assert read_json(str(features / "done.json"))["fingerprint"] == first_key
    assert read_json(str(features / "manifest.json"))["dtype"] == "float32"
    assert os.path.isdir(tmp_path / f"features.{changed.capture_fingerprint()}")


def test_a_stage_killed_halfway_is_not_taken_for_the_earlier_settings_work(tmp_path, monkeypatch):
    run = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}"]
    Pipeline(compose(run)).run()
    real_build = __import__("dflash.data.dataset", fromlist=["build_dataset"]).build_dataset

    def build_then_die(*args, **kwargs):  # the new dataset is in place, its done marker not yet
        real_build(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):  # an eval killed while it writes
        patch.setattr("dflash.eval.evaluate.plot_committed_histogram", must_not_run_interrupt)
        Pipeline(compose(run + ["eval.max_new_tokens=12", "stages=[eval]"])).run()
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr("dflash.data.dataset.build_dataset", build_then_die)
        Pipeline(compose(run + ["data.limit=16", "stages=[data]"])).run()
    # Back to the first settings: both stages are redone, not served from the killed runs' files.
    summary = Pipeline(compose(run + ["stages=[data,eval]"])).run()
    assert summary["max_new_tokens"] == 16
    assert read_json(str(tmp_path / "data" / "stats.json"))["total"] == 32


def must_not_run_interrupt(*args, **kwargs):
    raise KeyboardInterrupt
