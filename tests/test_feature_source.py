"""The FeatureSource protocol every capture mode implements, and the one on-disk form of captured samples."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from dflash.data.feature_source import FeatureSource, SampleList, as_feature_source, collate
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.extract.feature_cache import FeatureCache
from dflash.extract.fp8 import quantize_fp8
from dflash.extract.linked_source import LinkedFeatureSource
from dflash.extract.sample_format import decode_single, encode, load, sample_tensors
from dflash.extract.store import FeatureStore, ShardWriter
from dflash.train.batches import prepare_micro_batch
from dflash.train.loop import check_features


def samples(count: int = 3, width: int = 8) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        length = 5 + 2 * i
        out.append({"input_ids": torch.randint(0, 50, (length,), generator=generator),
                    "loss_mask": (torch.arange(length) >= 2).long(),
                    "hidden": torch.randn(length, width, generator=generator).to(torch.bfloat16)})
    return out


def write_store(path, rows) -> FeatureStore:
    lengths = [row["input_ids"].shape[0] for row in rows]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    writer = ShardWriter(path)
    entry = writer.write_shard(0, torch.cat([r["hidden"] for r in rows]), torch.cat([r["input_ids"] for r in rows]),
                               torch.cat([r["loss_mask"] for r in rows]), offsets, first_sample=0)
    writer.write_manifest({"schema_version": 1, "target_layer_ids": [1], "hidden_size": 8, "dtype": "bfloat16",
                           "num_samples": len(rows), "num_tokens": int(offsets[-1]), "complete": True,
                           "fingerprint": {}, "shards": [entry]})
    return FeatureStore(path)


def test_every_capture_mode_is_a_feature_source_and_a_list_becomes_one():
    for source in (FeatureStore, LinkedFeatureSource, ColocatedFeatureSource, SampleList):
        assert issubclass(source, FeatureSource), source
        assert source.serves_ahead(object.__new__(source)) == (source is not LinkedFeatureSource), source
    rows = samples()
    wrapped = as_feature_source(rows)
    assert isinstance(wrapped, SampleList) and len(wrapped) == 3 and wrapped[1] is rows[1]
    assert as_feature_source(wrapped) is wrapped


def test_a_store_serves_the_micro_batch_its_samples_pad_to(tmp_path):
    rows = samples()
    store = write_store(tmp_path / "store", rows)
    batch = store.micro_batch([2, 0])
    expected = collate([rows[2], rows[0]])
    assert batch.keys() == expected.keys()
    for key in expected:
        assert torch.equal(batch[key], expected[key]), key
    store.verify_features()  # checked when its shard was opened: nothing pending
    prepared = prepare_micro_batch(store, [(2, True), (0, False)], epoch=0, seed=0, num_anchors=2, block_size=2,
                                   gamma=4.0)
    from_list = prepare_micro_batch(rows, [(2, True), (0, False)], epoch=0, seed=0, num_anchors=2, block_size=2,
                                    gamma=4.0)
    for key in prepared:
        assert torch.equal(prepared[key], from_list[key]), key


def test_the_loop_reads_a_sources_deferred_checks_after_each_step():
    class Deferred(SampleList):
        def __init__(self, rows):
            super().__init__(rows)
            self.pending = False

        def micro_batch(self, indices, pin_memory=False):
            self.pending = True
            return super().micro_batch(indices, pin_memory)

        def verify_features(self, leave=0):
            if self.pending and not leave:
                self.pending = False
                raise ValueError("sample 1: tap 1 is constant")

    source = Deferred(samples())
    check_features(source, 0)  # nothing handed out yet
    prepare_micro_batch(source, [(1, True)], epoch=0, seed=0, num_anchors=2, block_size=2, gamma=4.0)
    check_features(source, 1)  # made ahead for the next step: its check stays pending
    with pytest.raises(ValueError, match="tap 1 is constant"):
        check_features(source, 0)
    check_features(samples(), 0)  # samples in memory have no checks


def test_a_cached_sample_a_one_sample_file_and_a_store_shard_share_one_format(tmp_path):
    row = samples(1)[0]
    store = write_store(tmp_path / "store", [row])
    offsets = torch.tensor([0, row["input_ids"].shape[0]])
    item = tmp_path / "item.safetensors"
    item.write_bytes(encode(sample_tensors(row["hidden"], row["input_ids"], row["loss_mask"], offsets)))
    cache = FeatureCache(tmp_path / "cache")
    cache.put(0, load(item))
    shard = tmp_path / "store" / "shard-00000.safetensors"
    for path in (item, cache.file(0), shard):
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"schema_version": "1"}, path
        tensors = load(path)
        assert {k: v.dtype for k, v in tensors.items()} == {"hidden": torch.bfloat16, "input_ids": torch.int32,
                                                              "loss_mask": torch.uint8, "offsets": torch.int64}
    for sample in (decode_single(load(item)), decode_single(cache.get(0)), store[0]):
        for key in row:
            assert torch.equal(sample[key], row[key]), key


def test_fp8_samples_carry_their_scales_and_read_back_dequantised():
    row = samples(1)[0]
    values, scales = quantize_fp8(row["hidden"].float(), 1)
    offsets = torch.tensor([0, row["input_ids"].shape[0]])
    tensors = sample_tensors(values, row["input_ids"], row["loss_mask"], offsets, scales)
    assert decode_single(tensors)["hidden"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="item 7: fp8 features need per-token scales"):
        sample_tensors(values, row["input_ids"], row["loss_mask"], offsets, what="item 7")
    with pytest.raises(ValueError, match="offsets cover 3 tokens"):
        sample_tensors(row["hidden"], row["input_ids"], row["loss_mask"], torch.tensor([0, 3]))


def test_a_cached_sample_of_an_earlier_run_is_read_and_another_schema_refused(tmp_path):
    row = samples(1)[0]
    offsets = torch.tensor([0, row["input_ids"].shape[0]])
    tensors = sample_tensors(row["hidden"], row["input_ids"], row["loss_mask"], offsets)
    cache = FeatureCache(tmp_path)
    cache.file(3).write_bytes(save(tensors))  # as the cache wrote samples before they carried the schema
    assert torch.equal(decode_single(cache.get(3))["hidden"], row["hidden"])
    cache.file(4).write_bytes(save(tensors, metadata={"schema_version": "2"}))
    with pytest.raises(ValueError, match="schema version 2, this code reads 1: capture the features again"):
        cache.get(4)
