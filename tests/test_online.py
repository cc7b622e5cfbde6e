"""Online capture through the spool: item order, backpressure, SIGKILL takeover, same loss as offline (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash.extract.capture import capture_dataset
from dflash.extract.online import CaptureWorker, ItemStream, OnlineFeatureSource, Spool
from dflash.extract.store import FeatureStore
from dflash.models.drafter_config import DrafterConfig
from dflash.models.targets import build_tiny_target
from dflash.data.batch_plan import BatchPlan
from dflash.train.engine import init_distributed
from dflash.config.schema import DeepSpeedSettings, TrainSettings
from dflash.train.loop import train
from dflash.train.metrics_log import MetricsLog
from tests.test_capture import make_dataset

REPO = Path(__file__).resolve().parents[1]
LENGTHS = [13, 9, 20, 12, 16, 10, 11]
LAYER_IDS = [1, 3]


@pytest.fixture(scope="module")
def dense():
    return build_tiny_target("llama", seed=0, tokenizer="builtin")


@pytest.fixture(scope="module")
def offline(dense, tmp_path_factory):
    """The offline store of the same data, one sample per batch (bitwise the same as the online workers)."""
    path = tmp_path_factory.mktemp("offline")
    capture_dataset(dense, make_dataset(LENGTHS), path, LAYER_IDS, batch_tokens=1, dtype="float32",
                    fingerprint={}, show_progress=False)
    return FeatureStore(path)


def test_a_chunks_newest_claim_is_found_and_claims_are_exclusive(tmp_path):
    spool = Spool(tmp_path / "spool", num_workers=2)
    assert spool.claim(7) is None
    assert spool.try_claim(7, 0, owner=0, share=0)
    assert not spool.try_claim(7, 0, owner=1, share=1)  # another worker made generation 0 first
    assert spool.try_claim(7, 1, owner=1, share=1)  # a takeover: the next generation, in the taker's share
    assert spool.claim(7) == (1, 1, 1) and spool.claim(8) is None


def test_item_stream_is_the_training_loops_read_order():
    plan = BatchPlan(num_samples=7, micro_batch_size=2, world_size=2, grad_accum=2, seed=3)
    stream = ItemStream(plan, epochs=2)
    for rank in range(2):
        expected = [(epoch, index)
                    for epoch in range(2) for step in range(plan.steps_per_epoch)
                    for slots in plan.micro_batches(epoch, step, rank) for index, _ in slots]
        got = [stream.item(g)[:2] for g in range(stream.num_items) if stream.item(g)[2] == rank]
        assert got == expected
    with pytest.raises(IndexError):
        stream.item(stream.num_items)


def test_backpressure_keeps_the_spool_within_budget(tmp_path, dense, offline):
    plan = BatchPlan(len(LENGTHS), micro_batch_size=2, world_size=1, grad_accum=1, seed=0)
    stream = ItemStream(plan, epochs=2)
    spool = Spool(tmp_path / "spool", num_workers=1)
    budget = 3 * 20 * (2 * 64 * 4 + 5) + 4 * 4096  # room for about two chunks of 2 items
    worker = CaptureWorker(dense, make_dataset(LENGTHS), spool, stream, LAYER_IDS, worker=0, budget_bytes=budget,
                           chunk_items=2, batch_tokens=1, dtype="float32", stale_after_s=5.0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    source = OnlineFeatureSource(spool, stream, rank=0, timeout_s=60)
    peak = 0
    for g in range(stream.num_items):
        time.sleep(0.02)  # a slow trainer: the worker runs ahead until its share is full, then waits
        peak = max(peak, spool.share_bytes(0))
        epoch, index, _ = stream.item(g)
        item = source[index]
        assert torch.equal(item["hidden"], offline[index]["hidden"])
        assert torch.equal(item["input_ids"], offline[index]["input_ids"])
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert 0 < peak <= budget
    assert not list((tmp_path / "spool" / "data").rglob("*"))[1:]  # only the empty share folder is left
    with pytest.raises(IndexError):
        source[0]
    with pytest.raises(ValueError, match="share of the spool budget"):
        CaptureWorker(dense, make_dataset(LENGTHS), spool, stream, LAYER_IDS, worker=0, budget_bytes=1000)


WORKER = """
import json, sys, time, torch
torch.set_num_threads(1)
from dflash.extract import online
from dflash.models.targets import build_tiny_target
from dflash.data.batch_plan import BatchPlan
from dflash.train.engine import init_distributed
from tests.test_capture import make_dataset

args = json.loads(sys.argv[1])
if args["stall"]:
    original, written = online._write_item, []
    def stalling(spool, share, g, tensors, writer):
        # Die (the parent kills us) in the middle of a chunk: one item written, the next one never.
        if len(written) == 3:
            open(args["stall"], "w").close()
            time.sleep(600)
        written.append(g)
        original(spool, share, g, tensors, writer)
    online._write_item = stalling
adapter = build_tiny_target("llama", seed=0, tokenizer="builtin")
plan = BatchPlan(len(args["lengths"]), args["micro"], args["world"], 1, 0)
stream = online.ItemStream(plan, epochs=args["epochs"])
spool = online.Spool(args["spool"], num_workers=2)
online.CaptureWorker(adapter, make_dataset(args["lengths"]), spool, stream, args["layer_ids"],
                     worker=args["worker"], budget_bytes=args["budget"], chunk_items=2, batch_tokens=1,
                     dtype="float32", stale_after_s=3.0).run()
"""


def test_a_packing_worker_streams_the_features_of_the_padded_capture(tmp_path, dense, offline, monkeypatch):
    calls = []
    packed = dense.capture_packed
    monkeypatch.setattr(dense, "capture_packed", lambda *args: calls.append(1) or packed(*args))
    plan = BatchPlan(len(LENGTHS), micro_batch_size=2, world_size=1, grad_accum=1, seed=0)
    stream = ItemStream(plan, epochs=1)
    spool = Spool(tmp_path / "spool", num_workers=1)
    worker = CaptureWorker(dense, make_dataset(LENGTHS), spool, stream, LAYER_IDS, worker=0, budget_bytes=1 << 24,
                           chunk_items=2, dtype="float32", pack=True)
    worker.run()
    assert calls  # the chunks went through capture_packed
    source = OnlineFeatureSource(spool, stream, rank=0, timeout_s=60)
    for g in range(stream.num_items):
        index = stream.item(g)[1]
        torch.testing.assert_close(source[index]["hidden"], offline[index]["hidden"], atol=1e-5, rtol=1e-5)


def start_worker(spool: Path, worker: int, stall: str, epochs: int = 2, world: int = 1) -> subprocess.Popen:
    args = dict(spool=str(spool), worker=worker, stall=stall, lengths=LENGTHS, layer_ids=LAYER_IDS, micro=2,
                world=world, epochs=epochs, budget=1 << 20)
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(args)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE)


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigkilled_worker_loses_no_sample_and_duplicates_none(tmp_path, offline):
    spool_dir, stall = tmp_path / "spool", tmp_path / "stalled"
    # Worker 1 starts alone, so it owns the first chunks; it stalls after 3 items, in the middle of chunk 1.
    workers = [start_worker(spool_dir, 1, str(stall), world=2)]
    try:
        deadline = time.monotonic() + 120
        while not stall.exists():
            assert time.monotonic() < deadline, "worker 1 never reached its stall point"
            assert workers[0].poll() is None, workers[0].stderr.read().decode()[-2000:]
            time.sleep(0.05)
        workers.insert(0, start_worker(spool_dir, 0, "", world=2))
        os.kill(workers[1].pid, signal.SIGKILL)
        workers[1].wait(timeout=30)

        plan = BatchPlan(len(LENGTHS), 2, 2, 1, 0)
        stream = ItemStream(plan, epochs=2)
        spool = Spool(spool_dir, num_workers=2)
        sources = [OnlineFeatureSource(spool, stream, rank=r, timeout_s=60) for r in range(2)]
        seen: list[tuple[int, int]] = []
        for g in range(stream.num_items):  # both trainer ranks, interleaved in item order
            epoch, index, rank = stream.item(g)
            item = sources[rank][index]
            assert torch.equal(item["hidden"], offline[index]["hidden"]), (g, index)
            seen.append((epoch, index))
        assert workers[0].wait(timeout=60) == 0, workers[0].stderr.read().decode()[-2000:]
    finally:
        for process in workers:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
    assert workers[1].returncode == -signal.SIGKILL
    for epoch in range(2):  # every sample once per epoch, plus the plan's zero-weight placeholders
        real = [index for e, index in seen if e == epoch][:len(LENGTHS)]
        assert sorted(real) == list(range(len(LENGTHS)))
    assert not [p for p in (spool_dir / "data").rglob("*") if p.is_file()]  # consumed files are deleted
    claims = sorted(p.name for p in (spool_dir / "claims").iterdir())
    assert any(name.endswith(".1") for name in claims)  # the dead worker's chunk was taken over
    with pytest.raises(ValueError, match="serves the batch plan"):
        OnlineFeatureSource(spool, ItemStream(BatchPlan(len(LENGTHS), 2, 1, 1, 0), epochs=2), rank=0)


@pytest.mark.multiproc
@pytest.mark.slow
def test_online_training_gives_the_offline_losses(tmp_path, dense, offline):
    embed, head = dense.embed_tokens().weight.detach(), dense.lm_head_weight().detach()
    config = DrafterConfig(hidden_size=dense.hidden_size, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=dense.vocab_size,
                           num_target_layers=dense.num_layers, target_layer_ids=LAYER_IDS, mask_token_id=3,
                           block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    settings = TrainSettings(epochs=2, micro_batch_size=2, grad_accum=1, lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95),
                             warmup_ratio=0.0, min_lr_ratio=0.1, grad_clip=1.0, num_anchors=4, gamma=4.0, seed=0,
                             loss_chunk_size=7, log_every=1, save_every=0)

    def run(store, name: str) -> list[float]:
        init_distributed()  # single-process gloo group, as the trainer tests do
        log = MetricsLog(str(tmp_path / name), enabled=True, tensorboard=False, wandb_mode="disabled",
                         wandb_project="t", config={})
        train(settings, config, store, (embed, head), str(tmp_path / name / "checkpoints"), log,
              deepspeed=DeepSpeedSettings(zero_stage=2, bf16=False), rank=0, world_size=1, device=torch.device("cpu"), show_progress=False)
        log.close()
        with open(tmp_path / name / "metrics.jsonl", encoding="utf-8") as f:
            return [json.loads(line)["loss"] for line in f]

    worker = start_worker(tmp_path / "spool", 0, "", epochs=settings.epochs)
    try:
        stream = ItemStream(BatchPlan(len(LENGTHS), 2, 1, 1, settings.seed), epochs=settings.epochs)
        online_losses = run(OnlineFeatureSource(Spool(tmp_path / "spool", 2), stream, rank=0, timeout_s=60),
                            "online")
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
    assert online_losses == run(offline, "offline")
    assert len(online_losses) == 8
