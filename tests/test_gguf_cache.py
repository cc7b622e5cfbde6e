"""The GGUF conversion cache (dflash/models/targets/gguf.py): one process converts a file at a time, and one that
waited takes the folder the other converted."""

from __future__ import annotations

import fcntl
import threading

import gguf as gguf_package
import pytest

from dflash.models.targets import gguf


def test_a_conversion_waits_for_the_lock_and_takes_what_the_holder_converted(tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "model-key"
    converted = []
    monkeypatch.setattr(gguf, "_convert", lambda source, target: converted.append(target))
    target.parent.mkdir(parents=True)
    with open(target.parent / f".{target.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process (another rank) is converting
        returned = []
        waiting = threading.Thread(target=lambda: returned.append(gguf.convert_gguf_file(source, target)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not returned
        target.mkdir()
        (target / gguf.SOURCE_FILE).write_text("{}")  # its conversion is published, then its lock released
    waiting.join(10)
    assert returned == [target] and converted == []
    # With no conversion there, the process that takes the lock converts.
    other = tmp_path / "cache" / "other-key"
    assert gguf.convert_gguf_file(source, other) == other and converted == [other]


def test_a_conversion_shares_one_reader_per_file_and_restores_the_gguf_package(tmp_path, monkeypatch):
    made = []

    class Reader:
        def __init__(self, path, mode="r"):
            made.append((path, mode))

    maps = []
    monkeypatch.setattr(gguf_package, "GGUFReader", Reader)
    monkeypatch.setattr(gguf_package, "get_tensor_name_map", lambda arch, blocks: maps.append((arch, blocks)) or {})
    (tmp_path / "a.gguf").write_bytes(b"")
    link = tmp_path / "same.gguf"
    link.symlink_to(tmp_path / "a.gguf")
    with pytest.raises(RuntimeError, match="loader failed"):
        with gguf.parsed_once():
            first = gguf_package.GGUFReader(str(tmp_path / "a.gguf"))
            assert gguf_package.GGUFReader(str(link)) is first  # the same file by another path
            assert gguf_package.GGUFReader(str(tmp_path / "b.gguf")) is not first
            for _ in range(3):
                gguf_package.get_tensor_name_map("llama", 30)
            raise RuntimeError("loader failed")
    assert len(made) == 2 and maps == [("llama", 30)]
    assert gguf_package.GGUFReader is Reader and gguf_package.get_tensor_name_map("llama", 30) == {}
    assert len(maps) == 2  # restored: the package's own function again, not the cached one
