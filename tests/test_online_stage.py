"""The train stage's side of online capture without a job of several processes: the cache decision and its tie to
the checkpoints, the capture:trainer split from the capture ranks' counters, and a capture rank's compiled target."""

from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch

from dflash.config import compose
from dflash.data.batch_plan import BatchPlan
from dflash.run_files import make_owned_dir, read_json, write_json
from dflash.train.capture_split import split_advice
from dflash.train.feature_cache_choice import choose_feature_cache
from dflash.train.rank_capture import RankCapture, plan_record
from tests.test_capture import LENGTHS, make_dataset


def put_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, value)


def test_a_resumed_run_uses_only_the_cache_decision_made_for_its_checkpoints(tmp_path):
    run_dir, log_dir = tmp_path / "run", tmp_path / "run" / "capture_logs"
    kept = tmp_path / "kept"
    make_owned_dir(str(kept))
    put_json(str(log_dir / "cache.json"), {"cache": True, "dir": str(kept), "checkpoint": "aaaa"})
    resume = functools.partial(choose_feature_cache, SimpleNamespace(cache_dir=None), run_dir=str(run_dir), info={},
                               hidden_size=64, epochs=3, resume_step=3)
    assert resume(checkpoint_key="aaaa") == {"cache": True, "dir": str(kept), "checkpoint": "aaaa"}
    # Checkpoints of other settings restored: the recorded cache is another run's, not read and not kept.
    fresh = {"cache": False, "dir": str(run_dir / "feature_cache"), "checkpoint": "bbbb"}
    assert resume(checkpoint_key="bbbb") == fresh and not kept.exists()
    assert json.loads((log_dir / "cache.json").read_text()) == fresh  # what the next restart reads
    put_json(str(log_dir / "cache.json"), {"cache": True, "dir": str(kept)})  # recorded before the fingerprint
    assert resume(checkpoint_key="aaaa")["cache"] is False


def test_a_resumed_run_keeps_the_cache_off_it_started_with_whatever_capture_cache_says_now(tmp_path):
    """Started with the cache off, a restart that turned it on would look for first-epoch features never kept."""
    run_dir = tmp_path / "run"
    off = {"cache": False, "dir": str(run_dir / "feature_cache"), "checkpoint": "aaaa"}
    put_json(str(run_dir / "capture_logs" / "cache.json"), off)
    settings = SimpleNamespace(cache="true", cache_dir=None, cache_budget_bytes=None, dtype="bfloat16")
    assert choose_feature_cache(settings, run_dir=str(run_dir), info={}, hidden_size=64, epochs=3,
                                checkpoint_key="aaaa", resume_step=2) == off


def test_one_epoch_keeps_no_cache_whatever_capture_cache_says(tmp_path):
    """Nothing would read a one-epoch cache back: off, without estimating or touching the disk (capture.cache=true
    with an epoch too large for the disk is no error either)."""
    settings = SimpleNamespace(cache="true", cache_dir=None, cache_budget_bytes=1, dtype="bfloat16")
    decided = choose_feature_cache(settings, run_dir=str(tmp_path), info={}, hidden_size=64, epochs=1,
                                   checkpoint_key="aaaa", resume_step=0)
    assert decided == {"cache": False, "dir": str(tmp_path / "feature_cache"), "checkpoint": "aaaa"}
    assert not (tmp_path / "feature_cache").exists()
    assert read_json(str(tmp_path / "capture_logs" / "cache.json")) == decided


@pytest.mark.parametrize("capture_rate,trainer_rate,devices,split", [
    (1000.0, 500.0, (2, 6), [3, 5]),   # capture twice as fast per device: a third of the devices capture
    (100.0, 900.0, (4, 4), [7, 1]),    # a slow target: every device but one trainer captures
    (900.0, 100.0, (1, 1), [1, 1]),    # at least one of each
])
def test_the_balanced_split_evens_out_the_two_rates(capture_rate, trainer_rate, devices, split):
    report = split_advice(capture_rate, trainer_rate, *devices)
    assert report["balanced_split"] == split and sum(split) == sum(devices)
    assert report["balanced_capture_fraction"] == pytest.approx(trainer_rate / (capture_rate + trainer_rate))


def test_the_split_counts_every_gpu_of_a_capture_rank(tmp_path):
    """Two capture ranks of 2 GPUs each (capture.gpus_per_worker=2), 1,000 tokens a second each: 4 capture devices
    of 500 tokens/s, against 4 trainer ranks of 250 tokens/s: a third of the 8 devices should capture."""
    stats = [{"tokens": 2000, "capture_s": 2.0, "gpus": 2, "credit_wait_s": 0.5} for _ in range(2)]
    link = SimpleNamespace(captures=2, capture_stats=lambda: stats)
    source = SimpleNamespace(close=lambda: None, tokens_read=1000, wait_s=1.0)
    RankCapture(link, None, "", "", str(tmp_path)).finish(source, train_s=5.0, rank=0, world_size=4)
    report = read_json(str(tmp_path / "capture_logs" / "throughput.json"))
    assert report["capture_devices"] == 4 and report["capture_tokens_per_s_per_device"] == pytest.approx(500.0)
    assert report["trainer_tokens_per_s_per_rank"] == pytest.approx(250.0) and report["balanced_split"] == [3, 5]
    assert report["capture_credit_wait_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_capture_rank_compiles_its_targets_layers_with_capture_compile(tmp_path, monkeypatch, compiled):
    """capture.compile: a capture rank only captures, so its target's layers are compiled while it streams."""
    from dflash.extract import capture_sender
    from dflash.models.targets import compile_target
    from dflash.stages import capture_role
    from dflash.stages.context import RunContext

    dataset = make_dataset()
    dataset.add_column("prompt_set", ["gsm8k"] * len(dataset)).save_to_disk(str(tmp_path / "data" / "dataset"))
    plan = BatchPlan(len(LENGTHS), 2, 1, 1, seed=0)
    start = {"data": str(tmp_path / "data"), "layer_ids": [1], "dtype": "float32", "batch_tokens": 64,
             "pack": True, "in_flight": 1, "epochs": 1, "first_step": 0,
             "plan": plan_record(plan, "tokens", num_anchors=8, block_size=4)}
    posted, compiled_then = [], []
    link = SimpleNamespace(rank=1, devices=[torch.device("cpu")], wait_start=lambda: start, post_stats=posted.append)
    compiling = []
    monkeypatch.setattr(compile_target, "compile_target_layers", lambda adapter: compiling.append(adapter) or 0)

    class Sender:
        def __init__(self, *args, **kwargs) -> None:
            self.units_sent = 0

        def run(self) -> None:
            compiled_then.append(len(compiling))

        def stats(self) -> dict:
            return {"tokens": 0, "capture_s": 0.0, "credit_wait_s": 0.0}

    monkeypatch.setattr(capture_sender, "CaptureSender", Sender)
    cfg = compose(["+experiment=tiny", "capture=online", f"capture.compile={str(compiled).lower()}",
                   f"run_dir={tmp_path / 'run'}"])
    capture_role._stream(RunContext(cfg), link)
    assert compiled_then == [1 if compiled else 0]
    assert posted == [{"tokens": 0, "capture_s": 0.0, "credit_wait_s": 0.0, "gpus": 1}]
