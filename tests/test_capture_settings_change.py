"""Changed settings: a capture redone under new settings moves the old feature store aside and going back restores
it (the training logs travel with their checkpoints the same way); a stage killed halfway is redone; two ranks run
colocated capture and training in one launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash.config import compose
from dflash.pipeline import Pipeline
from dflash.run_files import read_json

TINY = ["+experiment=tiny", "show_progress=false", "stages=[data,capture]"]


def must_not_run(*args, **kwargs):
    raise AssertionError("the capture ran again")


def test_changed_capture_settings_move_the_store_aside_and_back(tmp_path, monkeypatch):
    run = [f"run_dir={tmp_path}"]
    features = tmp_path / "features"
    first = Pipeline(compose(TINY + run))
    first.run()
    first_key = read_json(str(features / "done.json"))["fingerprint"]

    # Stored in bfloat16 instead of float32: other features, so the stage is redone, the old store kept aside.
    changed = Pipeline(compose(TINY + run + ["capture.dtype=bfloat16"]))
    changed.run()
    assert read_json(str(features / "done.json"))["fingerprint"] == changed.capture.fingerprint() != first_key
    assert read_json(str(features / "manifest.json"))["dtype"] == "bfloat16"
    aside = tmp_path / f"features.{first_key}"
    assert read_json(str(aside / "done.json"))["fingerprint"] == first_key

    with monkeypatch.context() as patch:  # back to the first settings: their store is restored, not recaptured
        patch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
        Pipeline(compose(TINY + run)).run()
    assert read_json(str(features / "done.json"))["fingerprint"] == first_key
    assert read_json(str(features / "manifest.json"))["dtype"] == "float32"
    assert os.path.isdir(tmp_path / f"features.{changed.capture.fingerprint()}")


@pytest.mark.slow
def test_a_stage_killed_halfway_is_not_taken_for_the_earlier_settings_work(tmp_path, monkeypatch):
    run = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}"]
    Pipeline(compose(run)).run()
    real_build = __import__("dflash.data.dataset", fromlist=["build_dataset"]).build_dataset

    def build_then_die(*args, **kwargs):  # the new dataset is in place, its done marker not yet
        real_build(*args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):  # an eval killed while it writes
        patch.setattr("dflash.eval.evaluate.plot_committed_histogram", must_not_run_interrupt)
        Pipeline(compose(run + ["eval.max_new_tokens=12", "stages=[eval]"])).run()
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr("dflash.data.dataset.build_dataset", build_then_die)
        Pipeline(compose(run + ["data.limit=16", "stages=[data]", "overwrite=true"])).run()
    # Back to the first settings: both stages are redone, not served from the killed runs' files. The drafter the
    # killed overwrite moved aside with the data it replaced comes back with that data, untrained.
    with monkeypatch.context() as patch:
        patch.setattr("dflash.train.loop.train", must_not_run)
        summary = Pipeline(compose(run)).run()
    assert summary["max_new_tokens"] == 16
    assert read_json(str(tmp_path / "data" / "stats.json"))["total"] == 32


def must_not_run_interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_going_back_to_earlier_settings_brings_their_training_logs_back(tmp_path):
    run = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data,capture,train]",
           "train.epochs=1"]

    def records() -> list[tuple[int, float]]:
        with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
            return [(r["step"], r["lr"]) for r in map(json.loads, f)]

    Pipeline(compose(run)).run()
    first = records()
    (tmp_path / "wandb" / "offline-run-first").mkdir(parents=True)  # as logging.wandb.mode=offline leaves it
    Pipeline(compose(run + ["train.lr=0.05", "overwrite=true"])).run()  # other settings: their own run and log
    other = records()
    assert [step for step, _ in other] == [step for step, _ in first] and other != first
    assert not (tmp_path / "wandb" / "offline-run-first").exists()  # wandb's runs travel with their drafter too
    Pipeline(compose(run + ["overwrite=true"])).run()  # back: the first run's checkpoints and log return together
    assert records() == first
    assert os.path.exists(tmp_path / "tensorboard") and (tmp_path / "wandb" / "offline-run-first").exists()


def test_where_a_gguf_target_is_cached_does_not_change_whose_answers_the_journal_holds(tmp_path):
    here = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path}"]))
    elsewhere = Pipeline(compose(["+experiment=tiny", f"run_dir={tmp_path}", f"target.cache_dir={tmp_path}"]))
    assert here.data.target_identity() == elsewhere.data.target_identity()
    assert "mask_token_id" not in here.data.target_identity() and here.data.target_identity()["kind"] == "tiny"


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_run_colocated_capture_and_training_in_one_launch(tmp_path):
    # Only rank 0 enters the capture stage with colocated capture: a barrier inside it would pair with the other
    # ranks' next one and hang the launch.
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    # --standalone: torchrun's stores listen at ports the OS gives them as they bind (a port found free here and
    # handed on could be taken by another listener before torchrun bound it).
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dflash.train",
         "+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data,capture,train]",
         "capture=colocated", "train.micro_batch_size=2"],
        env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_json(str(tmp_path / "export" / "done.json"))["fingerprint"]


def test_another_answer_length_and_back_reuses_the_first_answers_and_features(tmp_path, monkeypatch):
    run = ["+experiment=tiny", "show_progress=false", f"run_dir={tmp_path}", "stages=[data,capture]"]
    Pipeline(compose(run)).run()
    # Another answer length: a journal of its own, the first settings' journal and features moved aside.
    Pipeline(compose(run + ["data.max_new_tokens=24"])).run()
    with monkeypatch.context() as patch:  # back to the first settings: their answers and features come back
        patch.setattr("dflash.data.regenerate._hf_results", must_not_run)
        patch.setattr("dflash.data.regenerate._static_results", must_not_run)
        patch.setattr("dflash.extract.capture.capture_dataset", must_not_run)
        Pipeline(compose(run)).run()
