"""Capture index convention, early stop, the feature store format, resume and self-checks (tiny targets, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from dflash.extract import store as store_module
from dflash.data.dataset import FEATURES
from dflash.data.sample_sizes import sample_lengths
from dflash.extract.capture import capture_dataset, plan_shards
from dflash.extract.shard_rows import length_batches
from dflash.extract.feature_checks import feature_flags, packed_feature_flags
from dflash.extract.store import FeatureStore, read_manifest
from dflash.models.targets import build_tiny_target
from tests.schema_options import capture_options

LENGTHS = [13, 7, 20, 1, 16, 9, 11]
FINGERPRINT = {"target": "tiny", "dataset": "unit", "layer_ids": [1, 3, 6]}
# The captures here are padded (pack=False), the path the tests patch (adapter.capture); test_capture_packed.py
# compares it with packing.


@pytest.fixture(scope="module")
def dense():
    return build_tiny_target("llama", seed=0, tokenizer="builtin")


@pytest.fixture(scope="module")
def hybrid():
    return build_tiny_target("qwen3_5", seed=0, tokenizer="builtin")


def make_dataset(lengths: list[int] = LENGTHS, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for n in lengths:
        # Byte tokens only (ids 4..259): the special tokens never appear inside text.
        ids.append(torch.randint(4, 260, (n,), generator=g).tolist())
        masks.append([0] * (n // 2) + [1] * (n - n // 2))
    return Dataset.from_dict({"id": [f"s{i}" for i in range(len(lengths))], "input_ids": ids, "loss_mask": masks})


def reference_states(adapter, ids: list[int]) -> tuple:
    """HF output_hidden_states of one unpadded sequence."""
    with torch.no_grad():
        return adapter.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_capture_equals_output_hidden_states_with_padding(family, request):
    adapter = request.getfixturevalue(family)
    data = make_dataset([13, 7, 20])
    layer_ids = [6, 0, 3]  # unsorted on purpose; on the hybrid: GDN layers 0 and 6, full attention layer 3
    width = 20
    input_ids = torch.full((3, width), adapter.tokenizer.pad_token_id)
    attention_mask = torch.zeros((3, width), dtype=torch.long)
    for row, ids in enumerate(data["input_ids"]):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
    features = adapter.capture(input_ids, attention_mask, layer_ids)
    assert features.shape == (3, width, len(layer_ids) * adapter.hidden_size)
    h = adapter.hidden_size
    for row, ids in enumerate(data["input_ids"]):
        states = reference_states(adapter, ids)
        for k, layer_id in enumerate(layer_ids):
            torch.testing.assert_close(
                features[row, :len(ids), k * h:(k + 1) * h], states[layer_id + 1][0], atol=1e-5, rtol=1e-4
            )


def test_hybrid_really_is_a_gdn_hybrid(hybrid):
    assert hybrid.linear_attention_layer_ids() == [0, 1, 2, 4, 5, 6]
    assert hybrid.full_attention_layer_ids() == [3, 7]


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_capture_stops_after_deepest_tap_and_skips_lm_head(family, request):
    adapter = request.getfixturevalue(family)
    fired: list[str] = []
    hooks_before = [len(layer._forward_hooks) for layer in adapter.decoder_layers()]
    handles = [
        adapter.decoder_layers()[3].register_forward_hook(lambda *a: fired.append("layer3")),
        adapter.decoder_layers()[4].register_forward_hook(lambda *a: fired.append("layer4")),
        adapter.model.model.norm.register_forward_hook(lambda *a: fired.append("norm")),
        adapter.model.lm_head.register_forward_hook(lambda *a: fired.append("lm_head")),
    ]
    try:
        adapter.capture(torch.tensor([[5, 6, 7, 8]]), None, [1, 3])
        assert fired == ["layer3"]
        fired.clear()
        adapter.forward_with_features(torch.tensor([[5, 6, 7, 8]]), None, [1, 3])
        assert fired == ["layer3", "layer4", "norm", "lm_head"]
    finally:
        for handle in handles:
            handle.remove()
    assert [len(layer._forward_hooks) for layer in adapter.decoder_layers()] == hooks_before


@pytest.mark.parametrize(("bad", "named"), [([8], 8), ([-1], -1), ([0, 9], 9)])
def test_bad_layer_id_names_id_and_range(dense, bad, named):
    with pytest.raises(ValueError, match=rf"layer id {named} .*valid: 0\.\.7"):
        dense.capture(torch.tensor([[5, 6]]), None, bad)


def test_left_padding_rejected(dense):
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    with pytest.raises(ValueError, match="right-padded"):
        dense.capture(ids, torch.tensor([[1, 1, 1], [0, 1, 1]]), [1])
    with pytest.raises(ValueError, match="right-padded"):
        dense.forward_with_features(ids, torch.tensor([[1, 1, 1], [0, 1, 1]]), [1])


def test_empty_and_duplicate_layer_ids_rejected(dense):
    with pytest.raises(ValueError, match="empty"):
        dense.capture(torch.tensor([[5, 6]]), None, [])
    with pytest.raises(ValueError, match="duplicates"):
        dense.capture(torch.tensor([[5, 6]]), None, [2, 2])


def test_plan_and_batches():
    import numpy as np

    assert plan_shards(np.array([5, 5, 5, 5, 5]), 0, 10) == [(0, 2), (2, 4), (4, 5)]
    assert plan_shards(np.array([5, 5, 5, 5, 5]), 3, 10) == [(3, 5)]
    assert plan_shards(np.array([30, 1]), 0, 10) == [(0, 1), (1, 2)]
    batches = length_batches([3, 10, 4, 10, 1], batch_tokens=20)
    assert sorted(j for b in batches for j in b) == [0, 1, 2, 3, 4]
    assert batches[0] == [1, 3]  # the two longest together, 2 x 10 <= 20
    assert all(len(b) * max([3, 10, 4, 10, 1][j] for j in b) <= 20 or len(b) == 1 for b in batches)


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_store_round_trip(tmp_path, family, request):
    adapter = request.getfixturevalue(family)
    data = make_dataset()
    layer_ids = [1, 3, 6]
    manifest = capture_dataset(adapter, data, tmp_path / "store", layer_ids, fingerprint=FINGERPRINT,
                               show_progress=False,
                               **capture_options(pack=False, batch_tokens=48, shard_tokens=30, dtype="float32"))
    assert manifest["complete"] and manifest["num_samples"] == len(LENGTHS)
    assert manifest["num_tokens"] == sum(LENGTHS)
    assert len(manifest["shards"]) > 1
    assert sum(s["num_samples"] for s in manifest["shards"]) == len(LENGTHS)
    on_disk = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert on_disk == manifest
    assert on_disk["fingerprint"] == FINGERPRINT and on_disk["target_layer_ids"] == layer_ids
    assert on_disk["hidden_size"] == adapter.hidden_size and on_disk["dtype"] == "float32"

    store = FeatureStore(tmp_path / "store")
    assert len(store) == len(LENGTHS)
    assert store.lengths() == LENGTHS
    h = adapter.hidden_size
    for i in range(len(store)):
        item = store[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == data[i]["input_ids"]
        assert item["loss_mask"].dtype == torch.long and item["loss_mask"].tolist() == data[i]["loss_mask"]
        assert item["hidden"].shape == (LENGTHS[i], len(layer_ids) * h)
        states = reference_states(adapter, data[i]["input_ids"])
        for k, layer_id in enumerate(layer_ids):
            torch.testing.assert_close(
                item["hidden"][:, k * h:(k + 1) * h], states[layer_id + 1][0], atol=1e-5, rtol=1e-4
            )
    with pytest.raises(IndexError):
        store[len(LENGTHS)]


def test_default_dtype_is_bfloat16(tmp_path, dense):
    capture_dataset(dense, make_dataset([5, 6]), tmp_path, [2], fingerprint={}, show_progress=False,
                    **capture_options(pack=False))
    store = FeatureStore(tmp_path)
    assert store.manifest["dtype"] == "bfloat16"
    assert store[1]["hidden"].dtype == torch.bfloat16


def test_float16_store_rejected(tmp_path, dense):
    with pytest.raises(ValueError, match="float16"):
        capture_dataset(dense, make_dataset([5]), tmp_path, [2], fingerprint={}, show_progress=False,
                        **capture_options(pack=False, dtype="float16"))


def test_resume_after_interruption(tmp_path, dense, monkeypatch):
    data = make_dataset()
    kwargs = capture_options(pack=False, batch_tokens=48, shard_tokens=20, dtype="float32", fingerprint=FINGERPRINT,
                             show_progress=False)
    full = capture_dataset(dense, data, tmp_path / "full", [1, 3, 6], **kwargs)

    original = store_module.ShardWriter.write_shard
    writes: list[int] = []

    def interrupted(self, index, *args, **kw):
        if len(writes) == 2:
            raise KeyboardInterrupt("simulated interruption")
        writes.append(index)
        return original(self, index, *args, **kw)

    monkeypatch.setattr(store_module.ShardWriter, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        capture_dataset(dense, data, tmp_path / "resumed", [1, 3, 6], **kwargs)
    partial = read_manifest(tmp_path / "resumed")
    assert partial["complete"] is False and len(partial["shards"]) == 2
    with pytest.raises(ValueError, match="incomplete"):
        FeatureStore(tmp_path / "resumed")
    kept = {s["file"]: (tmp_path / "resumed" / s["file"]).stat().st_mtime_ns for s in partial["shards"]}

    def counting(self, index, *args, **kw):
        writes.append(index)
        return original(self, index, *args, **kw)

    writes.clear()
    monkeypatch.setattr(store_module.ShardWriter, "write_shard", counting)
    resumed = capture_dataset(dense, data, tmp_path / "resumed", [1, 3, 6], **kwargs)
    assert writes == list(range(2, len(full["shards"])))  # finished shards were not recomputed
    assert {f: (tmp_path / "resumed" / f).stat().st_mtime_ns for f in kept} == kept
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in full["shards"]]
    assert resumed["num_tokens"] == full["num_tokens"] and resumed["complete"]


def test_complete_store_returns_at_once_and_fingerprint_guard(tmp_path, dense, monkeypatch):
    data = make_dataset([4, 5])
    first = capture_dataset(dense, data, tmp_path, [2], fingerprint=FINGERPRINT, show_progress=False,
                            **capture_options(pack=False))

    def fail(*args, **kwargs):
        raise AssertionError("a complete store must not be recomputed")

    monkeypatch.setattr(dense, "capture", fail)
    assert capture_dataset(dense, data, tmp_path, [2], fingerprint=FINGERPRINT, show_progress=False,
                           **capture_options(pack=False)) == first
    with pytest.raises(ValueError, match="new output folder or delete"):
        capture_dataset(dense, data, tmp_path, [2], fingerprint={**FINGERPRINT, "dataset": "other"},
                        show_progress=False, **capture_options(pack=False))
    with pytest.raises(ValueError, match="target_layer_ids"):
        capture_dataset(dense, data, tmp_path, [3], fingerprint=FINGERPRINT, show_progress=False,
                        **capture_options(pack=False))


def test_corrupt_shard_detected_by_name(tmp_path, dense):
    capture_dataset(dense, make_dataset([6, 6, 6]), tmp_path, [2], fingerprint={}, show_progress=False,
                    **capture_options(pack=False, shard_tokens=6))
    shard = tmp_path / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(bytes(raw))
    store = FeatureStore(tmp_path)
    assert store[0]["hidden"].shape == (6, dense.hidden_size)  # shard 0 is intact
    with pytest.raises(ValueError, match="shard-00001.safetensors is corrupt"):
        store[1]
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        FeatureStore(tmp_path / "nowhere")


def test_self_check_names_sample_and_tap(tmp_path, dense, monkeypatch):
    original = dense.capture

    def dead_tap(input_ids, attention_mask, layer_ids):
        features = original(input_ids, attention_mask, layer_ids)
        features[..., dense.hidden_size:] = 0.0  # second tap all zeros, like a broken capture path
        return features

    monkeypatch.setattr(dense, "capture", dead_tap)
    with pytest.raises(ValueError, match=r"sample 's0': tap 4 has zero variance"):
        capture_dataset(dense, make_dataset([5]), tmp_path, [2, 4], fingerprint={}, show_progress=False,
                        **capture_options(pack=False))

    def overflowing(input_ids, attention_mask, layer_ids):
        features = original(input_ids, attention_mask, layer_ids)
        features[1, 2, 0] = float("inf")  # row 1 of the batch: s1, the shorter sample
        return features

    monkeypatch.setattr(dense, "capture", overflowing)
    with pytest.raises(ValueError, match=r"sample 's1': tap 2 has non-finite"):
        capture_dataset(dense, make_dataset([7, 5]), tmp_path / "inf", [2, 4], fingerprint={}, show_progress=False,
                        **capture_options(pack=False))


def test_crosscheck_catches_off_by_one_taps(tmp_path, dense, monkeypatch):
    original = dense.capture

    def shifted(input_ids, attention_mask, layer_ids):
        return original(input_ids, attention_mask, [i + 1 for i in layer_ids])

    monkeypatch.setattr(dense, "capture", shifted)
    with pytest.raises(ValueError, match=r"tap 2 differs from output_hidden_states\[3\]"):
        capture_dataset(dense, make_dataset([5]), tmp_path, [2], fingerprint={}, show_progress=False,
                        **capture_options(pack=False))


def test_sample_lengths_follow_the_rows_of_a_dataset_and_of_a_selection():
    rows = {"id": ["a", "b", "c"], "input_ids": [[1, 2, 3], [4], [5, 6]], "loss_mask": [[0, 1, 1], [1], [0, 1]],
            "prompt_set": ["x"] * 3}
    ds = Dataset.from_dict(rows, features=FEATURES)
    assert sample_lengths(ds).tolist() == [3, 1, 2]
    assert sample_lengths(ds.select([2, 0])).tolist() == [2, 3]


def test_feature_flags_look_at_real_rows_only_and_match_the_packed_layout():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 5, 8, generator=generator)
    features[1, 3:] = float("nan")  # padding of the shorter sample: neither checked nor counted
    flags = feature_flags(features, [5, 3], [1, 2])
    assert flags[:, :, 0].eq(1).all()
    for row, length in enumerate([5, 3]):
        for tap in range(2):
            real = features[row, :length, tap * 4:(tap + 1) * 4]
            assert flags[row, tap, 1].item() == pytest.approx(real.var(unbiased=False).item(), rel=1e-5)
    packed = torch.cat([features[0], features[1, :3]])
    assert torch.allclose(packed_feature_flags(packed, [5, 3], [1, 2]), flags, rtol=1e-5)
    features[1, 1, 5] = float("inf")  # a real row: caught
    assert feature_flags(features, [5, 3], [1, 2])[1, :, 0].tolist() == [1.0, 0.0]
