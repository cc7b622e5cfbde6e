"""capture.cache: online capture keeps the first epoch's features and the later epochs read them back (CPU)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal

import pytest
import torch

from dflash.config import compose
from dflash.extract.feature_cache import FeatureCache, cached_epochs
from dflash.extract.online import ItemStream, OnlineFeatureSource, Spool
from dflash.pipeline import Pipeline
from dflash.data.batch_plan import BatchPlan
from dflash.extract.capture import capture_dataset
from dflash.extract.store import FeatureStore
from dflash.models.targets import build_tiny_target
from tests.test_capture import make_dataset
from tests.test_online import LAYER_IDS, LENGTHS, start_worker
from tests.test_online_pipeline import ONLINE, STORED_CURVE, losses, new_run


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> FeatureStore:
    """The offline store of the capture worker's data (as in tests/test_online.py)."""
    path = tmp_path_factory.mktemp("offline")
    capture_dataset(build_tiny_target("llama", seed=0, tokenizer="builtin"), make_dataset(LENGTHS), path, LAYER_IDS,
                    batch_tokens=1, dtype="float32", fingerprint={}, show_progress=False)
    return FeatureStore(path)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cache-data")
    Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "stages=[data]"])).run()
    return run_dir / "data"


def test_cache_keeps_each_sample_once_and_names_a_missing_one(tmp_path):
    cache = FeatureCache(tmp_path / "cache")
    first = {"hidden": torch.ones(3, 4), "input_ids": torch.arange(3, dtype=torch.int32)}
    cache.put(7, first)
    cache.put(7, {"hidden": torch.zeros(3, 4), "input_ids": torch.zeros(3, dtype=torch.int32)})  # kept already
    assert 7 in cache and torch.equal(cache.get(7)["hidden"], first["hidden"])
    assert not list((tmp_path / "cache").glob(".*"))  # no temp file left
    with pytest.raises(FileNotFoundError, match="no sample 8"):
        cache.get(8)


def test_the_cache_is_used_when_it_fits():
    assert cached_epochs("auto", 100, None, free_bytes=1000)
    assert not cached_epochs("auto", 100, 99, free_bytes=1000)  # over its own budget
    assert not cached_epochs("auto", 100, None, free_bytes=50)  # over the free disk
    assert not cached_epochs("false", 1, None, free_bytes=1000)
    assert cached_epochs("true", 100, 200, free_bytes=1000)
    with pytest.raises(ValueError, match="capture.cache=true: one epoch"):
        cached_epochs("true", 100, None, free_bytes=50)
    with pytest.raises(ValueError, match="expected auto, true or false"):
        cached_epochs("sometimes", 1, None, free_bytes=1)


@pytest.mark.multiproc
@pytest.mark.slow
def test_workers_capture_one_epoch_and_later_epochs_come_from_the_cache(tmp_path, offline):
    worker = start_worker(tmp_path / "spool", 0, "", epochs=1)  # the workers' stream: the first epoch only
    try:
        stream = ItemStream(BatchPlan(len(LENGTHS), 2, 1, 1, 0), epochs=3)
        source = OnlineFeatureSource(Spool(tmp_path / "spool", 2), stream, rank=0, timeout_s=60,
                                     cache=FeatureCache(tmp_path / "cache"))
        for g in range(stream.num_items):
            epoch, index, _ = stream.item(g)
            assert torch.equal(source[index]["hidden"], offline[index]["hidden"]), (epoch, index)
            if g == stream.items_per_epoch - 1:
                assert worker.wait(timeout=60) == 0  # done after one epoch, before the trainer reads epoch 2
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == \
            [f"s{i:010d}.safetensors" for i in range(len(LENGTHS))]
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()


@pytest.mark.multiproc
@pytest.mark.slow
def test_pipeline_with_and_without_the_cache_trains_the_offline_losses(tmp_path, data_dir):
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    for mode in ("true", "false"):
        (tmp_path / mode).mkdir()
        run_dir = new_run(tmp_path / mode, data_dir)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            # A spool budget of 64 MiB (the tiny run's items take kilobytes): the cache's room is the free disk less
            # that budget and a margin, so the default 20 GiB would make the test depend on this machine's disk.
            Pipeline(compose(ONLINE + [f"run_dir={run_dir}", f"capture.cache={mode}",
                                       "capture.budget_bytes=67108864"])).run()
        torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(stored), rtol=2e-4, atol=2e-4)
        cached = list((run_dir / "feature_cache").glob("s*.safetensors"))
        samples = json.loads((run_dir / "features" / "online.json").read_text())["num_samples"]
        assert len(cached) == (samples if mode == "true" else 0)
        assert f"feature cache {'on' if mode == 'true' else 'off'}" in out.getvalue()
        assert not (run_dir / "spool").exists()
        shutil.rmtree(run_dir)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_resumed_run_keeps_the_cache_decision_it_started_with(tmp_path, data_dir):
    # Started with the cache off: a restart that turned it on would look for first-epoch features never kept.
    run_dir = new_run(tmp_path, data_dir)
    Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "capture.cache=false"])).run()
    (run_dir / "export" / "done.json").unlink()  # as if killed after the last checkpoint: the train stage resumes
    with contextlib.redirect_stdout(io.StringIO()) as out:
        Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "capture.cache=true"])).run()
    assert "feature cache off, as when this run started" in out.getvalue()
    assert not list((run_dir / "feature_cache").glob("s*.safetensors"))
