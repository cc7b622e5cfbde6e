"""The train stage's side of online capture without a job of several processes: the cache decision and its tie to
the checkpoints, the capture:trainer split from the capture ranks' counters, a capture rank's compiled target, and
its batch plan, built from its own settings and refused when it is not the trainers'."""

from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch

from dflash.config import ConfigError, compose
from dflash.data.batch_plan import grouping_keys
from dflash.run_files import make_owned_dir, read_json, write_json
from dflash.train import rank_capture
from dflash.train.capture_split import split_advice
from dflash.train.feature_cache_choice import choose_feature_cache
from dflash.train.rank_capture import RankCapture
from tests.test_capture import make_dataset


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


def test_a_cache_folder_a_trainer_rank_does_not_share_is_refused_not_read(tmp_path):
    """Trainer rank 0 prepares the cache folder and names it with a token of the run; a rank on another node whose
    capture.cache_dir is a folder of its own (not shared) would read nothing, or an earlier run's samples left
    there: it stops at the start, naming the folder."""
    from dflash.config import ConfigError
    from dflash.extract.feature_cache import FeatureCache

    run_dir = tmp_path / "run"
    put_json(str(tmp_path / "data" / "stats.json"), {"num_tokens": 10})
    settings = SimpleNamespace(cache="true", cache_dir=None, cache_budget_bytes=None, dtype="bfloat16")
    decided = choose_feature_cache(settings, run_dir=str(run_dir), info={"target_layer_ids": [1], "data": str(
        tmp_path / "data")}, hidden_size=8, epochs=3, checkpoint_key="aaaa", resume_step=0)
    assert decided["cache"] and len(decided["token"]) == 32
    assert FeatureCache(decided["dir"], decided["token"]).token() == decided["token"]  # the folder rank 0 prepared
    with pytest.raises(ConfigError, match=r"does not see the feature cache trainer rank 0 prepared for this run "
                                          r"\(no run.token there\)"):
        FeatureCache(tmp_path / "another-node", decided["token"])
    assert not (tmp_path / "another-node").exists()  # refused before it made a folder of its own
    stale = FeatureCache(tmp_path / "stale")
    stale.write_token("an earlier run")
    with pytest.raises(ConfigError, match="the run.token of another run there"):
        FeatureCache(stale.path, decided["token"])
    # A resumed run keeps its token; a decision recorded without one (before tokens) is not checked.
    assert choose_feature_cache(settings, run_dir=str(run_dir), info={}, hidden_size=8, epochs=3,
                                checkpoint_key="aaaa", resume_step=2) == decided
    FeatureCache(tmp_path / "before-tokens", None)


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


def announce_and_stream(tmp_path, monkeypatch, trainers: list[str], capture_rank: list[str]) -> tuple:
    """Trainer rank 0 of a job of one trainer, composed with `trainers`, announces its stream (RankCapture.source, its
    grouping keys computed as the train stage does); a capture rank composed with `capture_rank` then streams it
    through a sender that sends nothing. (The trainer's plan, [(the capture rank's plan, layers compiled while it
    sent)], the capture rank's posted counters)."""
    from dflash.extract import capture_sender
    from dflash.models.targets import compile_target
    from dflash.stages import capture_role
    from dflash.stages.context import RunContext

    dataset = make_dataset()
    dataset.add_column("prompt_set", ["gsm8k"] * len(dataset)).save_to_disk(str(tmp_path / "data" / "dataset"))
    features, checkpoints = tmp_path / "features", tmp_path / "checkpoints"
    put_json(str(features / "online.json"), {"data": str(tmp_path / "data"), "target_layer_ids": [1],
                                             "num_samples": len(dataset)})
    put_json(str(features / "target.json"), {"hidden_size": 64})
    checkpoints.mkdir()
    # One epoch: the feature cache is off without looking at the data's size.
    base = ["+experiment=tiny", "capture=online", "train.epochs=1", f"run_dir={tmp_path / 'run'}"]

    settings = RunContext(compose(base + trainers)).settings
    t, block_size = settings.train, settings.drafter.block_size
    lengths = grouping_keys(dataset, t.group_by, t.num_anchors, block_size).tolist() if t.group_by_length else None
    announced = []
    trainer_link = SimpleNamespace(announce=announced.append, wait_start=lambda: announced[-1],
                                   stream_start=lambda: announced[-1], captures=1)
    monkeypatch.setattr(rank_capture, "LinkedFeatureSource", lambda link, stream, *args: stream)
    trainer = RankCapture(trainer_link, settings.capture, str(features), str(checkpoints), str(tmp_path / "run"))
    stream = trainer.source(t, 0, 1, lengths)

    compiling, sent, posted = [], [], []
    monkeypatch.setattr(compile_target, "compile_target_layers", lambda adapter: compiling.append(adapter) or 0)

    class Sender:
        def __init__(self, link, stream, *args, **kwargs) -> None:
            self.stream, self.units_sent = stream, 0

        def run(self) -> None:
            sent.append((self.stream.plan, len(compiling)))

        def stats(self) -> dict:
            return {"tokens": 0, "capture_s": 0.0, "credit_wait_s": 0.0}

    monkeypatch.setattr(capture_sender, "CaptureSender", Sender)
    link = SimpleNamespace(rank=1, trainers=1, devices=[torch.device("cpu")], wait_start=lambda: announced[-1],
                           stream_start=lambda: announced[-1], post_stats=posted.append)
    capture_role._stream(RunContext(compose(base + capture_rank)), link)
    return stream.plan, sent, posted


@pytest.mark.parametrize("compiled", [True, False])
def test_a_capture_rank_compiles_its_targets_layers_with_capture_compile(tmp_path, monkeypatch, compiled):
    """capture.compile: a capture rank only captures, so its target's layers are compiled while it streams."""
    _, sent, posted = announce_and_stream(tmp_path, monkeypatch, [], [f"capture.compile={str(compiled).lower()}"])
    assert [layers for _, layers in sent] == [1 if compiled else 0]
    assert posted == [{"tokens": 0, "capture_s": 0.0, "credit_wait_s": 0.0, "gpus": 1}]


@pytest.mark.parametrize("grouped", [[], ["train.group_by_length=2", "train.group_by=work"]])
def test_a_capture_rank_streams_the_plan_the_trainers_train(tmp_path, monkeypatch, grouped):
    plan, sent, _ = announce_and_stream(tmp_path, monkeypatch, ["train.seed=7", *grouped], ["train.seed=7", *grouped])
    assert [ours for ours, _ in sent] == [plan] and plan.seed == 7 and bool(plan.lengths_digest) == bool(grouped)


@pytest.mark.parametrize("trainers,capture_rank,named", [
    (["train.micro_batch_size=4"], ["train.micro_batch_size=2"],
     r"train\.micro_batch_size \(trainers 4, this rank 2\)"),
    (["train.seed=1"], ["train.seed=2"], r"train\.seed \(trainers 1, this rank 2\)"),
    (["train.group_by_length=2"], [], r"train\.group_by_length \(trainers 2, this rank 0\); lengths_digest"),
    # Other grouping keys deal other batches: only the lengths' digest tells.
    (["train.group_by_length=2", "train.group_by=work"],
     ["train.group_by_length=2", "train.group_by=work", "drafter.block_size=8"], r"in lengths_digest \(trainers"),
])
def test_a_capture_rank_composed_with_other_train_settings_is_refused(tmp_path, monkeypatch, trainers, capture_rank,
                                                                      named):
    """Its plan would deal other samples than the trainers ask for: refused before streaming, naming the setting."""
    with pytest.raises(ConfigError, match=named):
        announce_and_stream(tmp_path, monkeypatch, trainers, capture_rank)
