"""Offline capture split over the ranks of a torchrun launch writes the store one process writes, and resumes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.config import compose
from dflash.extract import capture as capture_module
from dflash.extract.capture import capture_dataset, write_sidecar
from dflash.extract.store import ShardWriter, read_manifest
from dflash.models.targets import build_tiny_target
from dflash.pipeline import Pipeline
from tests.schema_options import capture_options
from tests.test_capture import FINGERPRINT, make_dataset
from tests.test_trainer import launcher_env

# 400 tokens per shard splits the tiny run's ~2.3k tokens into about 6 shards.
TINY = ["+experiment=tiny", "show_progress=false", "capture.shard_tokens=400"]


def store_files(folder: Path) -> dict[str, Path]:
    """The files of a feature store folder (manifest, shards, and anything else a capture left there)."""
    return {p.name: p for p in folder.iterdir() if p.name == "manifest.json" or p.name.startswith(("shard-", "."))}


def assert_same_store(got: Path, want: Path) -> None:
    assert sorted(store_files(got)) == sorted(store_files(want))  # no sidecar or temp file left
    assert read_manifest(got) == read_manifest(want)
    for entry in read_manifest(want)["shards"]:
        a, b = load_file(got / entry["file"]), load_file(want / entry["file"])
        assert sorted(a) == sorted(b), entry["file"]
        for name in b:
            assert torch.equal(a[name].float(), b[name].float()), (entry["file"], name)
    for name, path in store_files(want).items():
        assert (got / name).read_bytes() == path.read_bytes(), name


def two_rank_capture(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m dflash.extract` of the tiny run in run_dir, which must succeed. --standalone:
    torchrun's stores listen at ports the OS gives them as they bind (a port found free here and handed on could be
    taken by another listener before torchrun bound it)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dflash.extract",
         *TINY, f"run_dir={run_dir}", *overrides],
        env=launcher_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The tiny run's data and a 1-process capture of it."""
    run_dir = tmp_path_factory.mktemp("one")
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[data,capture]"])).run()
    assert len(read_manifest(run_dir / "features")["shards"]) >= 4
    return run_dir


@pytest.fixture(scope="module")
def two_ranks(one_rank, tmp_path_factory) -> tuple[Path, str]:
    """The same capture by `torchrun --nproc_per_node 2 -m dflash.extract` (data stage already done)."""
    run_dir = tmp_path_factory.mktemp("two")
    shutil.copytree(one_rank / "data", run_dir / "data")
    return run_dir, two_rank_capture(run_dir).stdout


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_rank_capture_writes_the_one_process_store(one_rank, two_ranks):
    run_dir, stdout = two_ranks
    num_shards = len(read_manifest(one_rank / "features")["shards"])
    for rank in (0, 1):  # each rank captured its own share (shards i with i % 2 == rank)
        assert f"rank {rank} of 2: {len(range(rank, num_shards, 2))} of {num_shards} shards" in stdout
    assert_same_store(run_dir / "features", one_rank / "features")
    for name in ("frozen_head.safetensors", "target.json", "done.json"):
        assert (run_dir / "features" / name).read_bytes() == (one_rank / "features" / name).read_bytes()


@pytest.mark.multiproc
def test_killed_two_rank_capture_resumes_on_one_rank(one_rank, two_ranks, tmp_path, monkeypatch):
    """The state a 2-rank capture leaves when rank 0 is killed after its first shard while rank 1 finished all of
    its own: the fresh manifest, shards with their sidecars, a temp file of the shard being written."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_ranks[0], run_dir)
    features = run_dir / "features"
    manifest = read_manifest(features)
    entries = manifest["shards"]
    os.remove(features / "done.json")
    ShardWriter(features).write_manifest(
        {**manifest, "complete": False, "num_samples": 0, "num_tokens": 0, "shards": []})
    lost = [index for index in range(len(entries)) if index % 2 == 0 and index > 0]
    for index, entry in enumerate(entries):
        if index in lost:
            os.remove(features / entry["file"])
        else:
            write_sidecar(features, index, entry)
    (features / f".{entries[lost[0]]['file']}.tmp-12345").write_bytes(b"half a shard")

    written: list[int] = []
    write_shard = ShardWriter.write_shard
    monkeypatch.setattr(ShardWriter, "write_shard",
                        lambda self, index, *a, **kw: written.append(index) or write_shard(self, index, *a, **kw))
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[data,capture]"])).run()
    assert written == lost  # the finished shards were kept
    assert_same_store(features, one_rank / "features")



@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_resume_a_partial_store_and_repair_a_corrupt_shard(one_rank, tmp_path):
    """A 1-process capture killed after shards 0 and 1 (shard 1 since corrupted) plus a sidecar shard 3, resumed by
    2 ranks with verify_existing: each rank hashes its own listed shards, keeps the intact ones and captures the
    rest of its share."""
    run_dir = tmp_path / "run"
    shutil.copytree(one_rank, run_dir)
    features = run_dir / "features"
    manifest = read_manifest(features)
    entries = manifest["shards"]
    os.remove(features / "done.json")
    listed = entries[:2]
    ShardWriter(features).write_manifest({
        **manifest, "complete": False, "shards": listed, "num_samples": sum(e["num_samples"] for e in listed),
        "num_tokens": sum(e["num_tokens"] for e in listed)})
    shard = bytearray((features / entries[1]["file"]).read_bytes())
    shard[-1] ^= 1
    (features / entries[1]["file"]).write_bytes(bytes(shard))
    write_sidecar(features, 3, entries[3])
    for entry in entries[2:3] + entries[4:]:
        os.remove(features / entry["file"])
    done = two_rank_capture(run_dir, "capture.verify_existing=true")
    n = len(entries)
    assert f"rank 0 of 2: {len(range(2, n, 2))} of {n} shards" in done.stdout  # all but shard 0
    assert f"rank 1 of 2: {1 + len(range(5, n, 2))} of {n} shards" in done.stdout  # 1 (corrupt) and 5, 7, ...
    assert f"{entries[1]['file']} is corrupt" in done.stdout
    assert_same_store(features, one_rank / "features")

def test_one_rank_resume_keeps_sidecar_shards_and_recaptures_the_rest(tmp_path, monkeypatch):
    """A partial manifest (shard 0), a sidecar shard 2, a sidecar planned with other samples (shard 3), a missing
    shard 1: shards 1 and 3 are recaptured, and the store equals an uninterrupted one."""
    adapter = build_tiny_target("llama", seed=0, tokenizer="builtin")
    data = make_dataset([13, 7, 20, 1, 16, 9, 11, 8, 14])
    kwargs = capture_options(pack=False, shard_tokens=15, fingerprint=FINGERPRINT, show_progress=False,
                             check_every=3, dtype="float32")
    want = capture_dataset(adapter, data, tmp_path / "want", [1, 3], **kwargs)
    entries = want["shards"]
    assert len(entries) >= 5
    shutil.copytree(tmp_path / "want", tmp_path / "got")
    got = tmp_path / "got"
    first = entries[0]
    ShardWriter(got).write_manifest({**want, "complete": False, "num_samples": first["num_samples"],
                                     "num_tokens": first["num_tokens"], "shards": [first]})
    os.remove(got / entries[1]["file"])
    write_sidecar(got, 2, entries[2])
    write_sidecar(got, 3, {**entries[3], "first_sample": entries[3]["first_sample"] + 1})
    for index in range(4, len(entries)):
        os.remove(got / entries[index]["file"])

    written: list[int] = []
    write_shard = ShardWriter.write_shard
    monkeypatch.setattr(ShardWriter, "write_shard",
                        lambda self, index, *a, **kw: written.append(index) or write_shard(self, index, *a, **kw))
    assert capture_dataset(adapter, data, got, [1, 3], **kwargs) == want
    assert written == [1, 3, *range(4, len(entries))]
    assert_same_store(got, tmp_path / "want")


def test_sidecars_without_a_manifest_belong_to_no_store_and_are_removed(tmp_path):
    adapter = build_tiny_target("llama", seed=0, tokenizer="builtin")
    data = make_dataset([13, 7, 20])
    out = tmp_path / "store"
    out.mkdir()
    (out / "shard-00000.safetensors").write_bytes(b"an old store's shard")
    write_sidecar(out, 0, {"file": "shard-00000.safetensors", "sha256": "0" * 64, "first_sample": 0,
                           "num_samples": 1, "num_tokens": 13})
    manifest = capture_dataset(adapter, data, out, [1, 3], fingerprint=FINGERPRINT, show_progress=False,
                               **capture_options(pack=False, shard_tokens=13, dtype="float32"))
    assert manifest["complete"] and not list(out.glob("shard-*.json"))
    assert capture_module.file_sha256(out / "shard-00000.safetensors") == manifest["shards"][0]["sha256"]


def test_several_ranks_need_a_process_group(tmp_path):
    adapter = build_tiny_target("llama", seed=0, tokenizer="builtin")
    with pytest.raises(ValueError, match="torch.distributed process group"):
        capture_dataset(adapter, make_dataset([5]), tmp_path, [1], fingerprint=FINGERPRINT, rank=1, world_size=2,
                        **capture_options(pack=False))
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 ranks"):
        capture_dataset(adapter, make_dataset([5]), tmp_path, [1], fingerprint=FINGERPRINT, rank=2, world_size=2,
                        **capture_options(pack=False))

