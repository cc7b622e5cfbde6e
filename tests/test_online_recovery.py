"""Online capture when workers die, stall or restart: budgets hold, no orphan file, restarts skip consumed items."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash.extract import online
from dflash.extract.online import CaptureWorker, ItemStream, OnlineFeatureSource, Spool
from dflash.models.targets import build_tiny_target
from dflash.data.batch_plan import BatchPlan
from tests.test_capture import make_dataset

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = [1, 3]
ITEM_BYTES = 20 * (2 * 64 * 4 + 5) + 4096  # one 20-token float32 item of two taps of the tiny llama, with overhead


@pytest.fixture(scope="module")
def dense():
    return build_tiny_target("llama", seed=0, tokenizer="builtin")


def make_worker(dense, spool: Spool, stream: ItemStream, worker: int, budget: int, chunk: int = 2) -> CaptureWorker:
    return CaptureWorker(dense, make_dataset([20] * stream.plan.num_samples), spool, stream, LAYER_IDS,
                         worker=worker, budget_bytes=budget, chunk_items=chunk, batch_tokens=1, dtype="float32",
                         stale_after_s=3.0)


def go_stale(spool: Spool, worker: int) -> None:
    """Make `worker`'s heartbeat look as old as a dead worker's."""
    then = time.time() - 1000
    os.utime(spool.path / "workers" / f"w{worker}", (then, then))


def item_files(spool: Spool) -> list[str]:
    return sorted(str(p.relative_to(spool.path / "data")) for p in (spool.path / "data").rglob("i*"))


def test_a_takeover_writes_into_the_takers_share_so_a_restarted_owner_keeps_its_budget(tmp_path, dense):
    stream = ItemStream(BatchPlan(12, 2, 1, 1, 0), epochs=1)
    spool = Spool(tmp_path / "spool", num_workers=2)
    budget = 2 * 2 * ITEM_BYTES  # each share holds exactly one chunk of 2 items
    dead, taker = make_worker(dense, spool, stream, 0, budget), make_worker(dense, spool, stream, 1, budget)
    assert dead.share_budget == dead.chunk_bytes(0)
    spool.heartbeat(0)
    assert spool.try_claim(0, 0, owner=0, share=0)  # worker 0 claims chunk 0 and dies before writing it
    go_stale(spool, 0)
    spool.heartbeat(1)
    assert taker._take_over_stale(0, 1, set()) is True
    assert item_files(spool) == ["w1/i000000000000.safetensors", "w1/i000000000001.safetensors"]
    assert spool.claim(0) == (1, 1, 1)
    # Worker 0's next life finds its share empty and fills it with the next chunk: no share holds two writers.
    restarted = make_worker(dense, spool, stream, 0, budget)
    spool.heartbeat(0)
    assert restarted._room(0, 1) and spool.try_claim(1, 0, owner=0, share=0)
    restarted._capture(1, 0, 0)
    assert all(spool.share_bytes(share) <= budget for share in range(2))
    # A dead worker's chunk that does not fit the taker's full share waits (False): run() then claims no new chunk.
    assert spool.try_claim(2, 0, owner=0, share=0)
    go_stale(spool, 0)
    assert taker._take_over_stale(0, 3, set()) is False
    assert spool.claim(2) == (0, 0, 0)


def test_a_worker_keeps_room_to_take_over_the_lower_chunk_of_a_worker_that_dies_for_good(tmp_path, dense):
    """Worker 0 claims chunk 0 and dies for good (no restart). Had worker 1 meanwhile filled its share with chunk 1,
    whose items the trainer reads only after chunk 0's, it could never take chunk 0 over: a deadlock."""
    stream = ItemStream(BatchPlan(12, 2, 1, 1, 0), epochs=1)
    spool = Spool(tmp_path / "spool", num_workers=2)
    survivor = make_worker(dense, spool, stream, 1, 2 * 2 * ITEM_BYTES)  # its share holds one chunk
    spool.heartbeat(0)
    assert spool.try_claim(0, 0, owner=0, share=0)
    thread = threading.Thread(target=survivor.run, daemon=True)  # a deadlock must fail the test, not hang it
    thread.start()
    death = threading.Timer(0.5, go_stale, (spool, 0))
    death.start()
    try:
        source = OnlineFeatureSource(spool, stream, rank=0, timeout_s=8)
        for g in range(stream.num_items):
            source[stream.item(g)[1]]
    finally:
        death.join()
        thread.join(timeout=30)
    assert not thread.is_alive() and survivor.items_captured == stream.num_items
    assert spool.claim(0) == (1, 1, 1) and item_files(spool) == []


def test_a_takeover_keeps_room_for_a_lower_chunk_whose_live_owner_may_still_die(tmp_path, dense):
    """Three workers, shares of three chunks. B takes over a dead worker's chunk 3 while A is still (slowly) on
    chunk 0: the takeover must keep room for chunk 0, or once A dies for good B's share is full of later items
    the trainer cannot read before item 0, and item 0 can never be written."""
    spool = Spool(tmp_path / "spool", num_workers=3)
    stream = ItemStream(BatchPlan(12, 2, 1, 1, 0), epochs=1)
    budget = 3 * 3 * 2 * ITEM_BYTES
    a, b, c = (make_worker(dense, spool, stream, w, budget) for w in range(3))
    for w in range(3):
        spool.heartbeat(w)
    assert spool.try_claim(0, 0, 0, 0)  # A: chunk 0, slow but alive
    assert b._room(1, 1, b._others_unwritten(0, 1)) and spool.try_claim(1, 0, 1, 1)
    b._capture(1, 1, 0)
    assert b._room(1, 2, b._others_unwritten(0, 2)) and spool.try_claim(2, 0, 1, 1)
    assert c._room(2, 3, c._others_unwritten(0, 3)) and spool.try_claim(3, 0, 2, 2)
    b._capture(2, 1, 0)
    go_stale(spool, 2)  # C dies for good
    spool.heartbeat(0)
    spool.heartbeat(1)
    assert b._take_over_stale(0, 4, {1, 2}) is False  # chunk 3 waits: the room is chunk 0's
    go_stale(spool, 0)  # A dies for good before writing chunk 0
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    source = OnlineFeatureSource(spool, stream, rank=0, timeout_s=30)
    for g in range(stream.num_items):
        source[stream.item(g)[1]]
    thread.join(timeout=30)
    assert not thread.is_alive() and item_files(spool) == []


def test_a_chunk_taken_from_a_stalled_worker_comes_back_when_its_taker_dies(tmp_path, dense):
    """A stalls on chunk 0 and is judged dead; B takes chunk 0 over and then dies for good. A, alive again, must
    take chunk 0 back although it claimed it in this life: nobody else is left to write it."""
    spool = Spool(tmp_path / "spool", num_workers=2)
    stream = ItemStream(BatchPlan(12, 2, 1, 1, 0), epochs=1)
    a = make_worker(dense, spool, stream, 0, 1 << 20)
    spool.heartbeat(0)
    assert spool.try_claim(0, 0, 0, 0)  # A's chunk 0, then A stalls
    assert spool.try_claim(0, 1, 1, 1)  # B took it over ...
    spool.heartbeat(1)
    go_stale(spool, 1)  # ... and died for good
    spool.heartbeat(0)
    assert a._take_over_stale(0, 1, {0}) is True
    assert all(spool.finished(stream, g) for g in a.chunk_items_of(0))


@pytest.mark.parametrize("late", ["after the read", "before the read"])
def test_a_stalled_worker_judged_dead_leaves_no_orphan_item(tmp_path, dense, monkeypatch, late):
    """Worker 0 stalls between its last checks and its rename; worker 1 takes its chunk over. Its late copy lands
    after the trainer consumed the item (the writer deletes it) or before (the consumer deletes both copies)."""
    stream = ItemStream(BatchPlan(4, 2, 1, 1, 0), epochs=1)
    spool = Spool(tmp_path / "spool", num_workers=2)
    stalled, resume = threading.Event(), threading.Event()
    write = online._write_item

    def stalling(spool_, share, g, tensors, writer):
        if writer == 0 and g == 1:
            stalled.set()
            resume.wait(timeout=30)
        write(spool_, share, g, tensors, writer)

    monkeypatch.setattr(online, "_write_item", stalling)
    zombie, taker = make_worker(dense, spool, stream, 0, 1 << 20), make_worker(dense, spool, stream, 1, 1 << 20)
    spool.heartbeat(0)
    spool.heartbeat(1)
    assert spool.try_claim(0, 0, owner=0, share=0)
    thread = threading.Thread(target=zombie._capture, args=(0, 0, 0))
    thread.start()
    try:
        assert stalled.wait(timeout=30)
        go_stale(spool, 0)
        assert taker._take_over_stale(0, 1, set()) is True
        source = OnlineFeatureSource(spool, stream, rank=0, timeout_s=10)
        if late == "before the read":
            resume.set()
            thread.join(timeout=30)
            assert "w0/i000000000001.safetensors" in item_files(spool)  # two copies of item 1 now
        for g in range(2):
            source[stream.item(g)[1]]
    finally:
        resume.set()
        thread.join(timeout=30)
    assert item_files(spool) == []
    assert spool.cursor(0) == 2


def test_a_restarted_worker_starts_at_the_lowest_rank_cursor(tmp_path, dense):
    stream = ItemStream(BatchPlan(12, 1, 2, 1, 0), epochs=1)  # two ranks; items alternate between them
    spool = Spool(tmp_path / "spool", num_workers=1)
    spool.set_cursor(0, 9)  # rank 0 read items up to 8, rank 1 up to 7 (a resume, or a worker restarted late)
    spool.set_cursor(1, 8)
    assert spool.consumed_below(2) == 8
    worker = make_worker(dense, spool, stream, 0, 1 << 20, chunk=2)
    worker.run()
    # Chunks 0-3 (items 0-7) were consumed: neither checked one by one nor claimed; chunk 4 holds item 9 only.
    assert sorted(p.name for p in (spool.path / "claims").iterdir()) == [f"c{c:09d}.0" for c in (4, 5)]
    assert item_files(spool) == [f"w0/i{g:012d}.safetensors" for g in (9, 10, 11)]
    assert worker.items_captured == 3


@pytest.mark.multiproc
def test_a_worker_whose_named_parent_is_gone_exits_at_once(tmp_path):
    """The parent passes its pid: a worker started by one that has died already (pid 1 is not its parent) exits
    before loading anything, instead of watching whichever process adopted it."""
    done = subprocess.run([sys.executable, "-m", "dflash.extract.online_workers", str(tmp_path / "spec.json"), "0",
                           "1"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr.decode()[-2000:]


def test_a_worker_waiting_for_room_polls_less_and_less_often(tmp_path, dense, monkeypatch):
    """Backpressure is the normal state when capture outpaces training; each poll stats the items in flight, so a
    waiting worker backs off (up to a cap) instead of polling every 20 ms."""
    stream = ItemStream(BatchPlan(12, 2, 1, 1, 0), epochs=1)
    spool = Spool(tmp_path / "spool", num_workers=1)
    worker = make_worker(dense, spool, stream, 0, 2 * ITEM_BYTES + ITEM_BYTES)  # room for one chunk only
    delays: list[float] = []

    class Waited(Exception):
        pass

    def sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == 10:
            raise Waited

    monkeypatch.setattr(online.time, "sleep", sleep)
    with pytest.raises(Waited):  # chunk 0 is written, nobody reads it: the worker waits for room
        worker.run()
    assert worker.items_captured == 2
    assert delays == sorted(delays) and delays[0] == online._POLL_S and delays[-1] == online._MAX_WAIT_POLL_S


def test_shares_smaller_than_one_chunk_per_worker_are_named_at_start(tmp_path, dense, capsys):
    """Every claim keeps room for the lower chunks other workers owe, so shares of fewer chunks than workers make
    the workers take turns: worker 0 says so, with the settings to change."""
    stream = ItemStream(BatchPlan(12, 2, 1, 1, 0), epochs=1)
    spool = Spool(tmp_path / "spool", num_workers=2)
    make_worker(dense, spool, stream, 0, 2 * 2 * ITEM_BYTES)  # one chunk per share
    assert "capture.budget_bytes" in capsys.readouterr().out
    make_worker(dense, spool, stream, 0, 2 * 2 * 2 * ITEM_BYTES)  # two chunks per share
    assert "warning" not in capsys.readouterr().out
