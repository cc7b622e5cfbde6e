"""capture.cache with capture=colocated: the first epoch's features kept in host memory, later micro-batches put
together from there without the target's forward (dflash/extract/feature_memory.py)."""

from __future__ import annotations

import json
import logging
import re
import threading

import numpy as np
import pytest
import torch
from datasets import Dataset

from dflash.config import ConfigError, compose, settings_from
from dflash.data.dataset import load_dataset_dir
from dflash.extract.colocated import ColocatedFeatureSource
from dflash.extract.feature_memory import CHUNK_BYTES, FeatureMemory, allocation_bytes, choose_feature_memory, \
    chunk_size
from dflash.pipeline import Pipeline
from tests.host_waits import host_waits, ours

LENGTHS = [5, 9, 3, 12, 7, 4]


def token_dataset(adapter, lengths=LENGTHS) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, adapter.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    return Dataset.from_dict({"id": [f"s{i}" for i in range(len(rows))], "input_ids": rows,
                              "loss_mask": [[0] * 2 + [1] * (len(r) - 2) for r in rows]})


def counting_capture(monkeypatch, adapter) -> list[int]:
    """Count the target's forwards (each appends its row count)."""
    calls: list[int] = []
    for name in ("capture", "capture_with_final"):
        real = getattr(adapter, name)

        def counted(ids, *args, real=real):
            calls.append(ids.shape[0])
            return real(ids, *args)

        monkeypatch.setattr(adapter, name, counted)
    return calls


def test_rows_come_back_padded_as_kept_across_chunks_and_dtypes():
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024)  # 16 float32 rows of 16, 32 bfloat16 rows of 16
    hidden = torch.randn(3, 10, 16)
    final = torch.randn(3, 10, 16).to(torch.bfloat16)
    memory.keep([7, 2, 7], [10, 4, 10], {"hidden": hidden, "target_final": final})  # 7 twice: kept once
    memory.keep([5], [9], {"hidden": hidden[2:], "target_final": final[2:]})
    assert len(memory.chunks["hidden"]) == 2 and len(memory.chunks["target_final"]) == 1  # 10 + 4, then 9
    assert memory.allocated_bytes == 3 * 1024 and memory.holds([2, 5, 7]) and not memory.holds([2, 3])
    batch = memory.recall([2, 5, 7], torch.device("cpu"))
    assert batch["hidden"].shape == (3, 10, 16) and batch["target_final"].dtype == torch.bfloat16
    for key, kept in (("hidden", hidden), ("target_final", final)):
        assert torch.equal(batch[key][0, :4], kept[1, :4]) and not batch[key][0, 4:].any()
        assert torch.equal(batch[key][1, :9], kept[2, :9]) and not batch[key][1, 9:].any()
        assert torch.equal(batch[key][2], kept[0])
    memory.forget([5])
    assert not memory.holds([5]) and memory.holds([2, 7])
    with pytest.raises(ValueError, match="a sample of 17 tokens does not fit"):
        memory.keep([9], [17], {"hidden": torch.zeros(1, 17, 16)})
    memory.close()
    assert memory.allocated_bytes == 0 and not memory.holds([2])


def test_chunks_hold_the_longest_sample_and_the_epoch_is_sized_with_their_unused_ends():
    hidden = {"hidden": (5 * 576, torch.bfloat16)}  # the SmolLM2 recipes: 5,760 bytes a token
    assert chunk_size(1024, hidden) == CHUNK_BYTES
    wide = {"hidden": (5 * 5120, torch.float32), "target_final": (5120, torch.float32)}  # a 27B target in float32
    assert chunk_size(4096, wide) == 1 << 29  # 4,096 x 102,400 bytes need 400 MiB: 512 MiB chunks
    assert FeatureMemory(False, 1 << 29)._append("hidden", torch.zeros(4096, 5 * 5120)) == (0, 0)
    per_chunk = CHUNK_BYTES // 5760  # 46,603 rows
    assert allocation_bytes(per_chunk - 1024, 1024, hidden, CHUNK_BYTES) == 2 * CHUNK_BYTES
    tokens = 6_799_495  # the GPU default's epoch: 36.5 GiB of rows in 150 chunks at most (147 in session 35's run)
    assert allocation_bytes(tokens, 1024, hidden, CHUNK_BYTES) == 150 * CHUNK_BYTES
    assert allocation_bytes(tokens, 1024, {**hidden, "target_final": (576, torch.bfloat16)}, CHUNK_BYTES) \
        == (150 + 30) * CHUNK_BYTES


def test_a_limited_memory_keeps_the_first_samples_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="dflash.extract.feature_memory")
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=4096, limit_bytes=2048)
    assert memory.expected_bytes == 2048  # allocated ahead up to the limit only
    memory.keep([0, 1, 2], [10, 10, 10], {"hidden": torch.randn(3, 10, 16)})  # a chunk each: the third is one too many
    assert memory.holds([0, 1]) and not memory.holds([2]) and memory.full and memory.allocated_bytes == 2048
    assert "host memory full at its limit of 0.00 GiB with 2 samples kept" in caplog.text
    memory.close()
    uneven = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=4096, limit_bytes=2560)
    assert uneven.expected_bytes == 2048  # never a chunk allocated ahead past the whole chunks the limit allows
    uneven.keep([0, 1, 2], [10, 10, 10], {"hidden": torch.randn(3, 10, 16)})
    assert uneven.allocated_bytes == 2048 and uneven.full
    uneven.close()


def test_memory_that_cannot_be_page_locked_ends_the_keeping_not_the_run(monkeypatch, caplog):
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024)
    memory.keep([0], [10], {"hidden": torch.randn(1, 10, 16)})

    def refused(self):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(FeatureMemory, "_allocate", refused)
    memory.keep([1, 2], [10, 3], {"hidden": torch.randn(2, 10, 16)})  # sample 1 needs a second chunk
    assert memory.full and memory.holds([0]) and not memory.holds([1]) and not memory.holds([2])
    assert "no more colocated features kept in host memory (1 samples kept" in caplog.text
    memory.keep([3], [8], {"hidden": torch.randn(1, 8, 16)})  # full: nothing more, no second warning
    assert not memory.holds([3]) and caplog.text.count("no more colocated") == 1
    assert memory.recall([0], torch.device("cpu"))["hidden"].shape == (1, 10, 16)


def allocations_on_threads(monkeypatch, fail_at: int | None = None) -> list[str]:
    """FeatureMemory._allocate patched to note the thread of each call (and to be refused at call `fail_at`)."""
    threads = []
    real = FeatureMemory._allocate

    def allocate(self):
        threads.append(threading.current_thread().name)
        if len(threads) == fail_at:
            raise RuntimeError("CUDA error: out of memory")
        return real(self)

    monkeypatch.setattr(FeatureMemory, "_allocate", allocate)
    return threads


def test_the_expected_chunks_are_allocated_from_the_start_in_the_background(monkeypatch):
    threads = allocations_on_threads(monkeypatch)
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=2 * 1024)  # 2 chunks of 16 rows
    memory._thread.join()  # both made before any sample is kept
    assert threads == ["dflash-feature-memory"] * 2 and memory.allocated_bytes == 0
    memory.keep([0, 1], [10, 10], {"hidden": torch.randn(2, 10, 16)})  # the two chunks, in order
    assert len(memory.chunks["hidden"]) == 2 and len(threads) == 2
    memory.keep([2], [10], {"hidden": torch.randn(1, 10, 16)})  # more than expected: allocated when needed
    assert threads[2] == threading.current_thread().name and len(memory.chunks["hidden"]) == 3
    assert memory.recall([0, 1, 2], torch.device("cpu"))["hidden"].shape == (3, 10, 16)
    memory.close()


def test_memory_refused_in_the_background_ends_the_keeping_at_that_chunk(monkeypatch, caplog):
    allocations_on_threads(monkeypatch, fail_at=2)
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=3 * 1024)
    memory._thread.join()  # it stopped at the refusal: no third chunk
    memory.keep([0, 1, 2], [10, 10, 10], {"hidden": torch.randn(3, 10, 16)})
    assert memory.holds([0]) and not memory.holds([1]) and memory.full and memory.allocated_bytes == 1024
    assert "no more colocated features kept in host memory (1 samples kept" in caplog.text
    memory.close()


def test_closing_stops_the_allocation_ahead_and_keeps_nothing_after(monkeypatch):
    threads = allocations_on_threads(monkeypatch)
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=100_000 * 1024)
    memory.close()
    assert not memory._thread.is_alive() and len(threads) < 100_000 and memory._ready.empty()
    memory.keep([0], [10], {"hidden": torch.randn(1, 10, 16)})  # returns (it used to wait for the stopped thread)
    assert not memory.holds([0])


def test_chunks_allocated_ahead_that_no_sample_took_go_back_once_the_epoch_is_kept(monkeypatch):
    threads = allocations_on_threads(monkeypatch)
    # The epoch's bound: 4 chunks; its 3 samples of 10 rows fill 2 (16 rows a chunk).
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=4 * 1024, samples=3)
    memory._thread.join()
    memory.keep([0, 1], [10, 10], {"hidden": torch.randn(2, 10, 16)})
    assert memory._ready.qsize() == 2 and memory._thread is not None
    memory.keep([2], [10], {"hidden": torch.randn(1, 10, 16)})  # the last sample: the two left over are dropped
    assert memory._ready.empty() and memory.allocated_bytes == 3 * 1024 and memory.holds([0, 1, 2])
    memory.forget([1])  # a failed check: captured and kept again later, in a chunk allocated then
    memory.keep([1], [10], {"hidden": torch.randn(1, 10, 16)})
    assert memory.holds([1]) and len(threads) == 5 and threads[-1] == threading.current_thread().name
    memory.close()


@pytest.mark.parametrize("final_hidden", [False, True])
def test_a_kept_micro_batch_skips_the_forward_and_equals_its_capture(tiny_target, monkeypatch, final_hidden):
    adapter = tiny_target("llama")
    dataset = token_dataset(adapter)
    source = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", final_hidden=final_hidden,
                                    memory=FeatureMemory(pin_memory=False))
    calls = counting_capture(monkeypatch, adapter)
    first, _ = source.get_batch([3, 0, 4])
    source.verify_features()
    again, lengths = source.get_batch([4, 3])  # both kept: no forward
    assert calls == [3] and lengths == [7, 12]
    assert again.keys() == first.keys() == ({"input_ids", "loss_mask", "hidden"} | ({"target_final"} if final_hidden
                                                                                  else set()))
    for key in again.keys() - {"input_ids", "loss_mask"}:
        assert torch.equal(again[key][0, :7], first[key][2, :7]) and torch.equal(again[key][1], first[key][0, :12])
        assert not again[key][0, 7:].any()
    mixed, _ = source.get_batch([0, 1])  # sample 1 is not kept: the target runs on it alone, and it is kept
    assert calls == [3, 1] and source.memory.holds([0, 1, 3, 4])
    plain = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", final_hidden=final_hidden)
    for got, picked in ((again, [4, 3]), (mixed, [0, 1])):
        expected, _ = plain.get_batch(picked)
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert (source.tokens_captured, source.tokens_recalled) == (12 + 5 + 7 + 9, 7 + 12 + 5)
    assert re.search(r"33 tokens captured, 24 read from host memory \(4 samples kept in 0\.\d\d GiB\)",
                     source.summary())


def test_a_micro_batch_in_part_kept_runs_the_target_on_the_others_and_checks_only_them(tiny_target, monkeypatch):
    adapter = tiny_target("llama")
    dataset = token_dataset(adapter)
    source = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", memory=FeatureMemory(pin_memory=False))
    plain = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32")
    source.get_batch([3, 0])
    source.verify_features()
    calls = counting_capture(monkeypatch, adapter)
    batch, lengths = source.get_batch([0, 5, 3, 5])  # 0 and 3 kept; 5 twice (a placeholder repeats it)
    assert calls == [2] and lengths == [5, 4, 12, 4] and len(source._pending) == 1
    expected, _ = plain.get_batch([0, 5, 3, 5])
    for key, value in expected.items():
        torch.testing.assert_close(batch[key], value, rtol=1e-5, atol=1e-5, msg=key)
    real = adapter.capture
    monkeypatch.setattr(adapter, "capture", lambda *a: real(*a).index_fill(2, torch.tensor([0]), float("nan")))
    source.get_batch([3, 2])  # 3 kept, 2 captured (bad)
    source.get_batch([0])  # made ahead: all kept
    with pytest.raises(ValueError, match=f"sample '{dataset[2]['id']}'"):
        source.verify_features(leave=1)
    assert source.memory.holds([0, 3, 5]) and not source.memory.holds([2])  # only the captured one is forgotten
    assert len(source._pending) == 1  # the batch made ahead is still pending
    source.verify_features()


def test_a_batch_whose_check_fails_is_not_kept(tiny_target, monkeypatch):
    adapter = tiny_target("llama")
    source = ColocatedFeatureSource(adapter, token_dataset(adapter), [0, 1], "float32",
                                    memory=FeatureMemory(pin_memory=False))
    real = adapter.capture
    monkeypatch.setattr(adapter, "capture", lambda *a: real(*a).index_fill(2, torch.tensor([0]), float("nan")))
    source.get_batch([2, 3])
    assert source.memory.holds([2, 3])  # kept while the check is pending
    with pytest.raises(ValueError, match="non-finite"):
        source.verify_features()
    assert not source.memory.holds([2]) and not source.memory.holds([3])


def test_the_memory_is_chosen_by_epochs_ranks_and_room(caplog, monkeypatch):
    from dflash.extract import feature_memory

    monkeypatch.setattr(feature_memory.psutil, "virtual_memory", lambda: type("M", (), {"available": 8 * 2**30}))
    caplog.set_level(logging.INFO, logger="dflash.extract.feature_memory")
    row = {"hidden": (1024, torch.float32)}  # 4 KiB a token: 65,536 rows a chunk

    def choose(mode, budget, gib, epochs=3, world_size=1):
        """The choice for an epoch of about `gib` GiB of chunks."""
        tokens = (int(gib * 2**30 / CHUNK_BYTES) - 1) * (65536 - 100)  # the chunks' bound: one more than these fill
        return choose_feature_memory(mode, budget, tokens=tokens, longest=100, widths=row, epochs=epochs,
                                     world_size=world_size, pin_memory=False)

    assert choose("false", None, 1) is None
    assert choose("auto", None, 1, epochs=1) is None
    assert "training has one epoch left to run" in caplog.text
    assert choose("auto", None, 1, world_size=2) is None
    assert "each of the 2 trainer ranks captures other samples" in caplog.text
    with pytest.raises(ConfigError, match="capture.cache=true with capture=colocated keeps a rank's own samples"):
        choose("true", None, 1, world_size=2)
    caplog.clear()
    part = choose("auto", None, 5)  # over half of 8 GiB: the first 4 GiB of it
    assert "5.00 GiB, more than the 4.00 GiB of 50% of the 8.0 GiB of host memory available, so about 80% of the " \
           "epoch's rows are kept, the first epoch's first samples; the later epochs batch them apart" in caplog.text
    assert part.limit_bytes == 4 * 2**30 and part.expected_bytes == 4 * 2**30 and part.widths == row
    part.close()
    with pytest.raises(ConfigError, match=r"takes 5.00 GiB, more than the 4.00 GiB the cache may use \(50% of"):
        choose("true", None, 5)
    kept = choose("auto", 6 * 2**30, 5)
    assert kept.limit_bytes is None and kept.expected_bytes == 5 * 2**30 and kept.chunk_bytes == CHUNK_BYTES
    kept.close()
    for budget, limit in ((2**30, 2**30), (16 * 2**30, 8 * 2**30)):  # its own budget; no more than is available
        part = choose("auto", budget, 9)
        assert part.limit_bytes == limit
        part.close()
    assert choose("auto", CHUNK_BYTES - 1, 5) is None  # not one chunk
    assert "leaves 0.25 GiB" in caplog.text
    memory = choose("true", None, 1, epochs=2)
    assert isinstance(memory, FeatureMemory) and "kept in host memory for the later epochs" in caplog.text
    memory.close()


def test_the_samples_that_fit_a_limited_memory_are_counted_as_keep_fills_its_chunks():
    widths = {"hidden": (16, torch.float32), "target_final": (4, torch.float32)}  # 64 and 16 bytes a row
    lengths = torch.randint(1, 17, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    for limit in (1024, 2048, 2560, 4096, None):
        fits = FeatureMemory(pin_memory=False, chunk_bytes=1024, limit_bytes=limit, widths=widths).prefix_that_fits(
            lengths)
        for only in (None, range(fits)):
            memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, limit_bytes=limit, widths=widths)
            if only is not None:
                memory.keep_only(only)
            for index, length in enumerate(lengths):
                memory.keep([index], [length], {"hidden": torch.randn(1, length, 16),
                                                "target_final": torch.randn(1, length, 4)})
            # Past the prefix a shorter sample may still fit a chunk's end; told the prefix, the memory keeps it alone.
            assert memory.holds(range(fits)) and (fits == len(lengths) or not memory.holds([fits])), limit
            assert only is None or len(memory.where) == fits
            memory.close()
    assert 0 < FeatureMemory(pin_memory=False, chunk_bytes=1024, limit_bytes=4096,
                             widths=widths).prefix_that_fits(lengths) < fits == len(lengths)


def test_a_memory_told_which_samples_to_keep_keeps_those_alone():
    memory = FeatureMemory(pin_memory=False, samples=6)
    memory.keep_only([4, 1])
    memory.keep([0, 1, 2, 4], [3, 3, 3, 3], {"hidden": torch.randn(4, 3, 8)})
    assert sorted(memory.where) == [1, 4] and memory.samples == 2


def test_a_memory_in_part_makes_the_later_epochs_mostly_kept_micro_batches(tiny_target, monkeypatch):
    """The first epoch keeps the samples that fit; the plan then batches them apart, and the later epochs run the
    target on far fewer micro-batches than a plan that mixes them, with the features a plain capture gives."""
    from dflash.data.batch_plan import BatchPlan

    adapter = tiny_target("llama")
    lengths = torch.randint(3, 13, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    dataset = token_dataset(adapter, lengths)
    plain = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32")
    widths = {"hidden": (2 * adapter.hidden_size, torch.float32)}
    forwards = {}
    for apart in (False, True):
        memory = FeatureMemory(pin_memory=False, chunk_bytes=16384, limit_bytes=4 * 16384, widths=widths)
        source = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", memory=memory)
        plan = BatchPlan(len(lengths), 4, 1, 1, seed=3)
        kept = source.kept_apart(plan.epoch_order(0)) if apart else 0
        if apart:  # token counts the caller hands over (the train stage has them) choose the same
            counted = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", lengths=np.array(lengths),
                                             memory=FeatureMemory(False, 16384, limit_bytes=4 * 16384, widths=widths))
            assert counted.kept_apart(plan.epoch_order(0)) == kept
        plan = BatchPlan(len(lengths), 4, 1, 1, seed=3, kept=kept)
        calls = counting_capture(monkeypatch, adapter)
        for epoch in range(3):
            for step in range(plan.steps_per_epoch):
                indices = [index for index, _ in plan.micro_batches(epoch, step, 0)[0]]
                batch, _ = source.get_batch(indices)
                source.verify_features()
                if epoch == 2 and step % 3 == 0:
                    expected, _ = plain.get_batch(indices)
                    calls.pop()  # the plain capture's
                    for key, value in expected.items():
                        torch.testing.assert_close(batch[key], value, rtol=1e-5, atol=1e-5, msg=key)
        forwards[apart] = len(calls) - plan.steps_per_epoch  # those of the later epochs
        if apart:
            assert 0 < kept < len(lengths) and memory.holds(plan.epoch_order(0)[:kept])
            assert len(memory.where) == kept
        monkeypatch.undo()
    assert forwards[True] == 2 * (plan.steps_per_epoch - kept // 4) < forwards[False]  # one mixed batch an epoch


def test_the_samples_kept_apart_are_chosen_at_the_start_and_resumed_as_saved(monkeypatch):
    """The plan's kept class is chosen when a run starts and saved with each checkpoint: a resumed run batches its
    later epochs as its start did, whatever its own source keeps now; a run saved before there was a class (no
    record) keeps mixing them."""
    from dflash.data.batch_plan import BatchPlan
    from dflash.data.feature_source import FeatureSource
    from dflash.train import checkpoint_policy
    from dflash.train.checkpoint_policy import CheckpointPolicy

    class Source(FeatureSource):
        def __init__(self):
            self.asked = []

        def __len__(self):
            return 10

        def kept_apart(self, order, kept=None):
            self.asked.append((list(order), kept))
            return 6 if kept is None else 0  # resumed, it keeps nothing (say, one epoch left: no memory)

    saved = []
    monkeypatch.setattr(checkpoint_policy, "save_checkpoint",
                        lambda engine, folder, step, state, **_: saved.append(state))
    settings = type("Settings", (), {"save_every": 1, "keep_last": 0})()
    plan = BatchPlan(10, 2, 1, 1, seed=4)
    for state, kept in (({"global_step": 0}, 6), ({"global_step": 3, "kept_samples": 4}, 4), ({"global_step": 3}, 0)):
        policy, source = CheckpointPolicy("unused", settings, plan.global_batch_size, rank=0), Source()
        resumed = policy.kept_apart(plan, source, state)
        assert source.asked == [(plan.epoch_order(0), None if state["global_step"] == 0 else kept)]
        assert resumed.kept == kept and resumed.epoch_order(0) == plan.epoch_order(0)
        policy.save(None, 5, None)
        assert saved[-1].get("kept_samples") == (kept or None)


def test_a_source_without_a_memory_in_part_keeps_nothing_apart(tiny_target):
    adapter = tiny_target("llama")
    dataset = token_dataset(adapter)
    order = list(range(len(LENGTHS)))
    assert ColocatedFeatureSource(adapter, dataset, [0, 1], "float32").kept_apart(order) == 0
    whole = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", memory=FeatureMemory(pin_memory=False))
    assert whole.kept_apart(order) == 0 and whole.memory.only is None  # the whole epoch fits: nothing apart
    limited = FeatureMemory(pin_memory=False, chunk_bytes=16384, limit_bytes=16384,
                            widths={"hidden": (2 * adapter.hidden_size, torch.float32)})
    resumed = ColocatedFeatureSource(adapter, dataset, [0, 1], "float32", memory=limited)
    assert resumed.kept_apart(order[::-1], 2) == 2 and limited.only == {5, 4}  # a resumed run's own count
    # Resumed with a memory that holds everything now, or with none (one epoch left): the count stands, and a
    # memory without a limit keeps every sample.
    assert whole.kept_apart(order, 2) == 2 and whole.memory.only is None
    assert ColocatedFeatureSource(adapter, dataset, [0, 1], "float32").kept_apart(order, 2) == 2


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_a_colocated_run_captures_each_sample_once_and_trains_the_same(tmp_path, accum):
    """The tiny run trains 3 epochs on one rank: the first epoch's micro-batches are captured (its placeholders, which
    repeat samples, too), the later ones read from memory; without the cache every micro-batch is captured, and
    without train.prepare_ahead each step's batches are made in it. The losses are the same every way (a capture in
    another micro-batch may differ by the kernels' rounding)."""

    def run(name: str, *overrides: str) -> tuple[int, int | None, list[float]]:
        run_dir = tmp_path / name
        Pipeline(compose(["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]",
                          f"run_dir={run_dir}", "capture=colocated", f"train.grad_accum={accum}", *overrides])).run()
        log = next((run_dir / "logs").glob("*.log")).read_text()
        found = re.search(r"colocated features: ([\d,]+) tokens captured(?:, ([\d,]+) read)?", log).groups()
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            losses = [json.loads(line)["loss"] for line in f]
        return (*(None if n is None else int(n.replace(",", "")) for n in found), losses)

    captured, recalled, kept = run("auto")
    every_epoch, none, captured_losses = run("false", "capture.cache=false")
    _, _, in_step = run("in_step", "capture.cache=false", "train.prepare_ahead=false")
    dataset = sum(len(row) for row in load_dataset_dir(tmp_path / "auto" / "data")["input_ids"])
    assert none is None and captured + recalled == every_epoch
    assert dataset <= captured < 1.2 * dataset and recalled > captured
    assert in_step == captured_losses  # the same batches, made earlier
    torch.testing.assert_close(torch.tensor(kept), torch.tensor(captured_losses), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_run_whose_epoch_is_kept_in_part_reads_whole_micro_batches_back(tmp_path, monkeypatch):
    """A tiny run with room for about an eighth of its epoch: what it keeps is one micro-batch of 4 samples of the
    first epoch, which each later epoch reads back whole (it used to be scattered over the later epochs' batches,
    each of them running the target anyway)."""
    from dflash.extract import feature_memory

    monkeypatch.setattr(feature_memory, "CHUNK_BYTES", 1 << 14)
    forwards, capture = [], ColocatedFeatureSource._capture
    monkeypatch.setattr(ColocatedFeatureSource, "_capture", lambda self, *a: forwards.append(1) or capture(self, *a))
    run_dir = tmp_path / "run"
    Pipeline(compose(["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]", f"run_dir={run_dir}",
                      "capture=colocated", "capture.cache_budget_bytes=600000"])).run()
    log = next((run_dir / "logs").glob("*.log")).read_text()
    assert "the later epochs batch them apart" in log and "[train] 4 of 19 samples kept apart" in log
    captured, recalled, kept = (int(n.replace(",", "")) for n in re.search(
        r"([\d,]+) tokens captured, ([\d,]+) read from host memory \((\d+) samples kept", log).groups())
    dataset = sum(len(row) for row in load_dataset_dir(run_dir / "data")["input_ids"])
    # Each epoch's last batch is filled with placeholders, which repeat samples: a little more than the dataset.
    assert kept == 4 and 3 * dataset <= captured + recalled < 3.6 * dataset and 0 < recalled and captured < 3 * dataset
    assert len(forwards) == 3 * 5 - 2  # 5 micro-batches an epoch; each later one reads the kept one back whole


class Interrupted(Exception):
    pass


@pytest.mark.slow
def test_a_run_stopped_in_its_last_epoch_resumes_the_kept_batches_order(tmp_path, monkeypatch):
    """Stopped after step 12 of 15 (the last epoch, where the resumed run has one epoch left and so no memory), the
    run resumes with the micro-batches an uninterrupted run trains on: the saved count orders them, not what the
    resumed run keeps."""
    from dflash.extract import feature_memory
    from dflash.train.checkpoint_policy import CheckpointPolicy

    monkeypatch.setattr(feature_memory, "CHUNK_BYTES", 1 << 14)
    served, get_batch = [], ColocatedFeatureSource.get_batch
    monkeypatch.setattr(ColocatedFeatureSource, "get_batch",
                        lambda self, indices, *a: served.append(list(indices)) or get_batch(self, indices, *a))

    def run(name: str) -> list[list[int]]:
        served.clear()
        Pipeline(compose(["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]",
                          f"run_dir={tmp_path / name}", "capture=colocated", "capture.cache_budget_bytes=600000",
                          "train.save_every=12", "train.prepare_ahead=false"])).run()
        return list(served)

    whole = run("whole")
    save = CheckpointPolicy.save

    def save_then_stop(self, engine, step, budget):
        save(self, engine, step, budget)
        if step == 12:
            raise Interrupted

    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        patch.setattr(CheckpointPolicy, "save", save_then_stop)
        run("stopped")
    assert served == whole[:12] and len(whole) == 15
    assert run("stopped") == whole[12:]


@pytest.mark.parametrize("override,message", [
    ("capture.cache=sometimes", "capture.cache='sometimes': expected auto, true or false"),
    ("capture.cache_budget_bytes=0", "capture.cache_budget_bytes=0: expected a number > 0"),
])
def test_bad_cache_settings_are_named_when_composed(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings_from(compose(["+experiment=tiny", "capture=colocated", override]))


@pytest.mark.gpu(reason="page-locked memory, asynchronous copies")
def test_on_cuda_kept_rows_come_back_without_a_host_wait():
    memory = FeatureMemory(pin_memory=True)
    hidden = torch.randn(2, 12, 32, device="cuda")
    memory.keep([0, 1], [12, 5], {"hidden": hidden})
    assert memory.chunks["hidden"][0].is_pinned()
    with host_waits() as waits:
        memory.keep([2], [12], {"hidden": hidden[:1] * 2})
        batch = memory.recall([1, 2, 0], torch.device("cuda"))
    assert not waits, waits
    assert torch.equal(batch["hidden"][0, :5], hidden[1, :5]) and not batch["hidden"][0, 5:].any()
    assert torch.equal(batch["hidden"][1], hidden[0] * 2) and torch.equal(batch["hidden"][2], hidden[0])


def test_a_resumed_run_counts_the_epochs_it_has_left(tmp_path, monkeypatch):
    """The tiny run: 19 samples, 4 a step, 5 steps an epoch, 3 epochs. Resumed in its second epoch, one more is left
    to read the memory back; resumed in its last, none is."""
    from dflash.extract.colocated import ColocatedFeatureSource as Source
    from dflash.train import checkpoints

    overrides = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "capture=colocated"]
    Pipeline(compose(overrides + ["stages=[data,capture]"])).run()
    train = Pipeline(compose(overrides)).train
    for newest, kept in ((None, True), (5, True), (9, True), (10, False)):
        monkeypatch.setattr(checkpoints, "complete_tags", lambda _, n=newest: [] if n is None else [(n, f"step{n}")])
        source = train.colocated_source()
        assert isinstance(source, Source) and (source.memory is not None) == kept, newest
        source.close()


def test_no_chunk_is_page_locked_while_cuda_graphs_record(monkeypatch):
    """capture.cuda_graphs records the target's graphs at the first micro-batch, the held-out replay its step's:
    no chunk is allocated in the background meanwhile (a CUDA call from another thread fails a capture), and the
    allocation goes on after."""
    import time

    from dflash.inference.cuda_graphs import RECORDING

    timeline, real_allocate = [], FeatureMemory._allocate

    def allocate(self):
        timeline.append("allocate")
        time.sleep(0.002)
        return real_allocate(self)

    monkeypatch.setattr(FeatureMemory, "_allocate", allocate)
    memory = FeatureMemory(pin_memory=False, chunk_bytes=1024, expected_bytes=300 * 1024)  # ~0.6 s of allocations
    with RECORDING:
        timeline.append("recording")
        time.sleep(0.05)  # time enough for many allocations, had the thread not waited
        timeline.append("recorded")
    memory._thread.join()
    recording = timeline.index("recording")
    assert timeline[recording + 1] == "recorded" and timeline.count("allocate") == 300
    assert "allocate" in timeline[recording + 2:]  # the recording held the thread up: it allocated after
    memory.close()


def test_graphs_are_recorded_holding_the_recording_lock(monkeypatch):
    """capture_graphs, every CUDA graph's capture, holds RECORDING while it records (not while it warms up): shown
    with torch's CUDA calls stood in for."""
    from dflash.inference import cuda_graphs

    held = []
    stand_in = type("StandIn", (), {"__enter__": lambda self: self, "__exit__": lambda self, *exc: None,
                                    "wait_stream": lambda self, other: None})
    for name in ("device", "Stream", "stream", "current_stream", "graph"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: stand_in())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    cuda_graphs.capture_graphs(torch.device("cuda"), [1, 2], prepare=lambda shape: None,
                               run=lambda shape: held.append(cuda_graphs.RECORDING.locked()))
    assert held == [False, False, True, True]  # a warm-up of each shape, then their recordings
    assert not cuda_graphs.RECORDING.locked()


@pytest.mark.gpu(reason="page-locked memory, asynchronous copies")
def test_on_cuda_a_micro_batch_in_part_kept_is_made_without_a_host_wait(tmp_path):
    overrides = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "capture=colocated",
                 "device=cuda:0"]
    Pipeline(compose(overrides + ["stages=[data,capture]"])).run()
    source = Pipeline(compose(overrides)).train.colocated_source()
    assert source.memory is not None and source.memory.pin_memory
    source.get_batch([0, 1], pin_memory=True)
    source.verify_features()
    with host_waits() as waits:
        batch, _ = source.get_batch([1, 2, 0], pin_memory=True)  # 0 and 1 kept, 2 captured alone
    assert not ours(waits), ours(waits)
    plain = ColocatedFeatureSource(source.adapter, source.dataset, source.layer_ids,
                                   str(source.dtype).removeprefix("torch."))
    expected, _ = plain.get_batch([1, 2, 0])
    torch.testing.assert_close(batch["hidden"].float(), expected["hidden"].float(), rtol=2e-2, atol=2e-2)
    assert source.tokens_recalled == sum(len(source.dataset[i]["input_ids"]) for i in (1, 0))
    source.close()
