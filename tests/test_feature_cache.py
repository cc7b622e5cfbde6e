"""capture.cache: the first epoch's online features kept on disk for the later epochs (the folder, the room it may
use). The pipeline's runs with the cache on and off: tests/test_online_ranks.py."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from dflash.extract import feature_cache
from dflash.extract.feature_cache import DISK_MARGIN_FRACTION, FeatureCache, cache_room, cached_epochs

Usage = namedtuple("Usage", "total used free")


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


def test_the_cache_leaves_a_margin_of_its_disk(tmp_path, monkeypatch):
    total, free = 1000 * 2**20, 600 * 2**20
    monkeypatch.setattr(feature_cache.shutil, "disk_usage", lambda path: Usage(total, total - free, free))
    room = cache_room(str(tmp_path))
    assert room == free - int(DISK_MARGIN_FRACTION * total)
    assert cached_epochs("auto", room, None, room) and not cached_epochs("auto", room + 1, None, room)
    monkeypatch.setattr(feature_cache.shutil, "disk_usage", lambda path: Usage(total, total, 0))
    assert cache_room(str(tmp_path)) == 0
