"""The feature store repairs itself: a shard found missing or corrupt is recaptured by the next run of
the same command, with a warning naming it, and the run ends as an uninterrupted one."""

import hashlib
import json

import pytest

from dflash.config import compose
from dflash.config.schema import schema_default
from dflash.extract.capture import capture_dataset
from dflash.pipeline import Pipeline

TINY = ["+experiment=tiny", "show_progress=false", "capture.shard_tokens=400"]


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip(path) -> None:
    """16 bytes inverted inside the tensor data (past the safetensors header)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 64, len(data) - 48):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def captured(tmp_path):
    run = TINY + [f"run_dir={tmp_path}", "stages=[data,capture]"]
    Pipeline(compose(run)).run()
    manifest = json.loads((tmp_path / "features" / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    shards = {e["file"]: sha(tmp_path / "features" / e["file"]) for e in manifest["shards"]}
    return tmp_path, run, manifest, shards


def test_a_deleted_shard_is_recaptured_by_the_same_command(captured, capsys):
    run_dir, run, manifest, shards = captured
    lost = manifest["shards"][1]["file"]
    (run_dir / "features" / lost).unlink()
    Pipeline(compose(run)).run()
    assert f"{lost} (samples" in capsys.readouterr().err
    assert {f: sha(run_dir / "features" / f) for f in shards} == shards  # the same bytes as the first capture


def test_a_corrupt_shard_met_in_training_is_set_aside_and_recaptured(captured):
    run_dir, run, manifest, shards = captured
    bad = run_dir / "features" / manifest["shards"][2]["file"]
    flip(bad)
    with pytest.raises(ValueError, match=rf"{bad.name} is corrupt.*rerun the same command"):
        Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[train]"])).run()
    assert (bad.parent / (bad.name + ".corrupt")).is_file() and not bad.exists()
    Pipeline(compose(TINY + [f"run_dir={run_dir}", "stages=[data,capture,train]"])).run()
    assert sha(bad) == shards[bad.name]
    assert (run_dir / "export" / "done.json").is_file()


def test_verify_existing_hashes_a_finished_store(captured):
    run_dir, run, manifest, shards = captured
    bad = run_dir / "features" / manifest["shards"][0]["file"]
    flip(bad)
    Pipeline(compose(run)).run()  # a finished stage is not re-hashed unless asked
    assert sha(bad) != shards[bad.name]
    Pipeline(compose(run + ["capture.verify_existing=true"])).run()
    assert sha(bad) == shards[bad.name]


def test_a_complete_store_missing_a_shard_is_completed_not_returned(captured):
    run_dir, run, manifest, shards = captured
    lost = manifest["shards"][-1]["file"]
    (run_dir / "features" / lost).unlink()
    pipeline = Pipeline(compose(run))
    from dflash.data.dataset import load_dataset_dir

    again = capture_dataset(pipeline.adapter, load_dataset_dir(str(run_dir / "data")), run_dir / "features",
                            manifest["target_layer_ids"], batch_tokens=8192, shard_tokens=400, dtype="float32",
                            check_every=schema_default("capture.check_every"), fingerprint=manifest["fingerprint"],
                            show_progress=False, pack=True)
    assert again["complete"] and sha(run_dir / "features" / lost) == shards[lost]
