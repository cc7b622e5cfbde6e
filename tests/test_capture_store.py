"""Feature-store hardening: disk preflight, SIGKILL resume, sampled re-forward checks, fp8 stores (CPU, tiny)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dflash.config import compose
from dflash.extract import capture as capture_module
from dflash.extract import feature_checks
from dflash.extract import store as store_module
from dflash.extract.capture import capture_dataset
from dflash.extract.fp8 import dequantize_fp8, quantize_fp8
from dflash.extract.store import FeatureStore, read_manifest
from dflash.models.targets import build_tiny_target
from dflash.pipeline import Pipeline
from tests.schema_options import capture_options
from tests.test_capture import LENGTHS, make_dataset

REPO = Path(__file__).resolve().parents[1]
KWARGS = capture_options(pack=False, batch_tokens=48, shard_tokens=20, dtype="float32", fingerprint={"unit": 1},
                         show_progress=False)


@pytest.fixture(scope="module")
def dense():
    return build_tiny_target("llama", seed=0, tokenizer="builtin")


def test_disk_preflight_prints_and_refuses(tmp_path, dense, monkeypatch, capsys):
    data = make_dataset()
    capture_dataset(dense, data, tmp_path / "ok", [1, 3], **KWARGS)
    printed = capsys.readouterr().out
    # 2 taps x hidden 64 x 4 bytes + id 4 + mask 1 per token, plus offsets and shard headers.
    assert "[capture] will write 0.00 GiB of feature shards in" in printed and str(tmp_path / "ok") in printed
    actual = sum(p.stat().st_size for p in (tmp_path / "ok").glob("shard-*"))
    needed = sum(LENGTHS) * (2 * 64 * 4 + 5)
    assert needed <= actual <= needed + 7 * (1 << 16)

    monkeypatch.setattr(capture_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))

    def must_not_run(*args, **kwargs):
        raise AssertionError("capture must not start when the store does not fit")

    monkeypatch.setattr(dense, "capture", must_not_run)
    folder = tmp_path / "full"
    with pytest.raises(OSError, match=rf"not enough disk in {folder}: it needs \d+ bytes .*: .* of feature shards.*"
                                      rf"only 1000 bytes"):
        capture_dataset(dense, data, tmp_path / "full", [1, 3], **KWARGS)
    assert not list((tmp_path / "full").glob("shard-*"))


def recorded_checks(monkeypatch) -> list[str]:
    """The ids of the samples compared with a plain forward from here on, in order (the comparison still runs)."""
    checked: list[str] = []
    original_check = feature_checks.crosscheck_sample

    def recording(adapter, ids, features, layer_ids, sample_id, final=None):
        checked.append(sample_id)
        original_check(adapter, ids, features, layer_ids, sample_id, final)

    monkeypatch.setattr(feature_checks, "crosscheck_sample", recording)
    return checked


def test_sampled_reforward_check_every_n(tmp_path, dense, monkeypatch):
    checked = recorded_checks(monkeypatch)
    data = make_dataset()
    capture_dataset(dense, data, tmp_path / "every3", [1, 3], **{**KWARGS, "check_every": 3})
    assert sorted(checked) == ["s0", "s3", "s6"]
    checked.clear()
    capture_dataset(dense, data, tmp_path / "never", [1, 3], **{**KWARGS, "check_every": 0})
    assert checked == []
    with pytest.raises(ValueError, match="check_every"):
        capture_dataset(dense, data, tmp_path / "bad", [1, 3], **{**KWARGS, "check_every": -1})

    # A batched path that is wrong for one sample only (s6, 11 tokens) on one tap only (layer 3).
    original = dense.capture

    def wrong_for_s6(input_ids, attention_mask, layer_ids):
        features = original(input_ids, attention_mask, layer_ids)
        lengths = attention_mask.sum(dim=1).tolist()
        for row, n in enumerate(lengths):
            if n == LENGTHS[6]:
                features[row, :, dense.hidden_size:] *= 1.5
        return features

    monkeypatch.setattr(dense, "capture", wrong_for_s6)
    with pytest.raises(ValueError, match=r"sample 's6': tap 3 differs from output_hidden_states\[4\]"):
        capture_dataset(dense, data, tmp_path / "wrong", [1, 3], **{**KWARGS, "check_every": 3})


def test_online_capture_compares_one_sample_in_check_every_in_capture_order(dense, monkeypatch):
    """capture=online's producer (a capture rank's) checks as offline capture does, its samples counted in the
    order it captures them: the trainers' batches come in any order of dataset indices."""
    from dflash.extract.capture_sender import target_producer

    checked = recorded_checks(monkeypatch)
    data = make_dataset()
    produce = target_producer(dense, data, [1, 3], 48, "float32", pack=False, check_every=3)
    produce([5, 1])  # captured 0 and 1: 0 checked
    produce([6, 0, 2, 4])  # captured 2 to 5: 3 checked
    assert checked == ["s5", "s0"]
    checked.clear()
    target_producer(dense, data, [1, 3], 48, "float32", pack=False)([3, 4])  # check_every 0: none
    assert checked == []
    real = dense.capture
    monkeypatch.setattr(dense, "capture", lambda *args: real(*args) * 1.5)
    with pytest.raises(ValueError, match=r"sample 's2': tap 1 differs from output_hidden_states\[2\]"):
        target_producer(dense, data, [1, 3], 48, "float32", pack=False, check_every=3)([2])


def test_the_plain_forward_runs_compiled_layers_eagerly(dense, monkeypatch):
    """capture.compile compiles the decoder layers; the check's one-row forward must not compile them again."""
    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    layers = dense.decoder_layers()
    for layer in layers:
        monkeypatch.setattr(layer, "forward", torch.compile(layer.forward, backend=counting_backend, dynamic=True),
                            raising=False)
    ids = [1, 5, 9, 4, 7]
    features = dense.capture(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), [1, 2])[0]
    compiled.clear()
    feature_checks.crosscheck_sample(dense, ids, features, [1, 2], "s")
    assert compiled == []


def test_stale_temp_files_removed_on_resume(tmp_path, dense):
    (tmp_path / "store").mkdir()
    stale = tmp_path / "store" / ".shard-00000.safetensors.tmp-99999"
    stale.write_bytes(b"half a shard")
    capture_dataset(dense, make_dataset([5, 6]), tmp_path / "store", [2], **KWARGS)
    assert not stale.exists()
    assert len(FeatureStore(tmp_path / "store")) == 2


CHILD = """
import sys, time, torch
torch.set_num_threads(1)
from dflash.extract import store as store_module
from dflash.extract.capture import capture_dataset
from dflash.models.targets import build_tiny_target
from tests.schema_options import capture_options
from tests.test_capture import make_dataset

original = store_module.file_sha256
def stalled(path):
    # Shard 2 stalls after its temp file is fully written and before its rename: the parent kills us here.
    if "shard-00002" in str(path):
        time.sleep(600)
    return original(path)
store_module.file_sha256 = stalled
adapter = build_tiny_target("llama", seed=0, tokenizer="builtin")
capture_dataset(adapter, make_dataset(), sys.argv[1], [1, 3, 6], fingerprint={"unit": 1}, show_progress=False,
                **capture_options(pack=False, batch_tokens=48, shard_tokens=20, dtype="float32"))
"""


@pytest.mark.multiproc
def test_sigkill_then_rerun_recomputes_nothing_complete(tmp_path, dense, monkeypatch):
    data = make_dataset()
    full = capture_dataset(dense, data, tmp_path / "full", [1, 3, 6], **KWARGS)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(out)], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # guards against a hang only: a loaded CI machine is slow
        while True:
            manifest = read_manifest(out) if out.is_dir() else None
            if manifest and len(manifest["shards"]) >= 2 and list(out.glob(".shard-00002.safetensors.tmp-*")):
                break
            if child.poll() is not None:
                raise AssertionError(f"capture child exited early: {child.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("capture child did not reach shard 2 in time")
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == -signal.SIGKILL
    killed = read_manifest(out)
    assert killed["complete"] is False and [s["file"] for s in killed["shards"]] == [
        "shard-00000.safetensors", "shard-00001.safetensors"]
    with pytest.raises(ValueError, match="incomplete"):
        FeatureStore(out)
    kept = {s["file"]: (out / s["file"]).stat().st_mtime_ns for s in killed["shards"]}

    writes: list[int] = []
    original = store_module.ShardWriter.write_shard

    def counting(self, index, *args, **kw):
        writes.append(index)
        return original(self, index, *args, **kw)

    monkeypatch.setattr(store_module.ShardWriter, "write_shard", counting)
    resumed = capture_dataset(dense, data, out, [1, 3, 6], **KWARGS)
    assert writes == list(range(2, len(full["shards"])))  # the two complete shards were not recomputed
    assert {f: (out / f).stat().st_mtime_ns for f in kept} == kept
    assert not list(out.glob(".*.tmp-*"))
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in full["shards"]]
    assert resumed == full
    store, reference = FeatureStore(out), FeatureStore(tmp_path / "full")
    for i in range(len(store)):
        assert torch.equal(store[i]["hidden"], reference[i]["hidden"])


def test_fp8_codec_per_token_per_tap_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3 * 16, generator=g)
    x[0, :16] *= 1e-4   # a tiny tap next to normal ones keeps its own scale
    x[1, 16:32] *= 1e3  # an outlier token/tap block does not crush the others
    x[2, 32:] = 0.0     # an all-zero block stays zero (no NaN)
    q, scales = quantize_fp8(x, num_taps=3)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6, 3) and scales.dtype == torch.float32
    back = dequantize_fp8(q, scales, torch.float32)
    assert torch.equal(back[2, 32:], torch.zeros(16))
    for row in range(6):
        for k in range(3):
            block, ref = back[row, 16 * k:16 * (k + 1)], x[row, 16 * k:16 * (k + 1)]
            if ref.abs().max() > 0:
                assert float((block - ref).norm() / ref.norm()) < 0.05, (row, k)
    with pytest.raises(ValueError, match="multiple"):
        quantize_fp8(torch.zeros(2, 10), num_taps=3)


def test_fp8_store_round_trip(tmp_path, dense):
    data = make_dataset()
    layer_ids = [1, 3, 6]
    capture_dataset(dense, data, tmp_path / "f32", layer_ids, **KWARGS)
    manifest = capture_dataset(dense, data, tmp_path / "fp8", layer_ids, **{**KWARGS, "dtype": "fp8"})
    assert manifest["dtype"] == "fp8"
    with safe_open(str(tmp_path / "fp8" / manifest["shards"][0]["file"]), framework="pt") as f:
        assert f.get_slice("hidden").get_dtype() == "F8_E4M3"
        assert f.get_slice("scales").get_shape() == [manifest["shards"][0]["num_tokens"], len(layer_ids)]
    exact, compressed = FeatureStore(tmp_path / "f32"), FeatureStore(tmp_path / "fp8")
    h = dense.hidden_size
    for i in range(len(exact)):
        a, b = exact[i], compressed[i]
        assert b["hidden"].dtype == torch.bfloat16 and b["hidden"].shape == a["hidden"].shape
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in range(len(layer_ids)):
            ref, got = a["hidden"][:, k * h:(k + 1) * h], b["hidden"][:, k * h:(k + 1) * h].float()
            assert float((got - ref).norm() / ref.norm()) < 0.05
    # fp8 features take a quarter of float32 plus 4 bytes of scale per token and tap.
    size = {name: sum(p.stat().st_size for p in (tmp_path / name).glob("shard-*")) for name in ("f32", "fp8")}
    assert size["fp8"] < 0.35 * size["f32"]


def test_corrupt_or_missing_shard_is_named_and_recaptured(tmp_path, dense, capsys):
    data = make_dataset()
    first = capture_dataset(dense, data, tmp_path, [1, 3], **KWARGS)
    shard = tmp_path / first["shards"][1]["file"]
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    (tmp_path / first["shards"][2]["file"]).unlink()
    untouched = (tmp_path / first["shards"][0]["file"]).stat().st_mtime_ns
    # Complete: a missing shard is recaptured, but the listed ones are not re-hashed unless asked.
    assert capture_dataset(dense, data, tmp_path, [1, 3], **KWARGS) == first
    printed = capsys.readouterr().out
    assert f"{first['shards'][2]['file']} is missing" in printed and "is corrupt" not in printed

    repaired = capture_dataset(dense, data, tmp_path, [1, 3], **{**KWARGS, "verify_existing": True})
    printed = capsys.readouterr().out
    assert f"{shard} is corrupt" in printed and "is missing" not in printed
    assert repaired == first  # same samples, same bytes, same manifest
    assert (tmp_path / first["shards"][0]["file"]).stat().st_mtime_ns == untouched
    FeatureStore(tmp_path).verify_all()


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A tiny run folder whose data stage has run, with 4 prompts held out and best_by at T=1."""
    run_dir = tmp_path_factory.mktemp("tiny-data")
    overrides = ["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", "data.heldout=4",
                 "train.best_by=tau_T1"]
    Pipeline(compose(overrides + ["stages=[data]"])).run()
    return run_dir, overrides


@pytest.mark.parametrize("mode", ["offline", "colocated"])
def test_the_disk_check_counts_the_frozen_head_and_held_out_features(tiny_data, tmp_path, monkeypatch, mode):
    source, overrides = tiny_data
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    overrides = overrides[:2] + [f"run_dir={run_dir}"] + overrides[3:] + [f"capture={mode}", "stages=[capture]"]
    checked = []
    original = capture_module.check_disk
    monkeypatch.setattr(capture_module, "check_disk", lambda *args: checked.append(args) or original(*args))
    Pipeline(compose(overrides)).run()
    [(_, store_bytes, other_bytes)] = checked
    assert (store_bytes is None) == (mode == "colocated")
    features = run_dir / "features"
    written = sum(p.stat().st_size for p in features.glob("*.safetensors") if not p.name.startswith("shard-"))
    assert written > 0 and {p.name for p in features.glob("heldout*")} >= {"heldout.safetensors"}
    # Counted before any work, the sampled held-out passes at their longest: never less than what was written.
    assert written <= other_bytes <= 2 * written

    # One byte short of it: refused before anything is written, naming what does not fit.
    shutil.rmtree(run_dir)
    shutil.copytree(source, run_dir)
    monkeypatch.setattr(capture_module.shutil, "disk_usage",
                        lambda path: SimpleNamespace(free=(store_bytes or 0) + other_bytes - 1))
    with pytest.raises(OSError, match=rf"not enough disk in {run_dir / 'features'}: it needs "
                                      rf"{(store_bytes or 0) + other_bytes} bytes .* for the stage's other files"):
        Pipeline(compose(overrides)).run()
    assert not list(features.glob("*.safetensors"))
    if mode == "offline":  # a complete store whose other files did not fit: checked again, without the shards
        shutil.rmtree(run_dir)
        shutil.copytree(source, run_dir)
        monkeypatch.setattr(capture_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 40))
        Pipeline(compose(overrides)).run()
        (features / "frozen_head.safetensors").unlink()
        (features / "done.json").unlink()
        monkeypatch.setattr(capture_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=other_bytes - 1))
        with pytest.raises(OSError, match=r"it needs \d+ bytes .*: 0.00 GiB of feature shards and .* for the stage"):
            Pipeline(compose(overrides)).run()
        assert not (features / "frozen_head.safetensors").exists()
