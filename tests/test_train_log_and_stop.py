"""The trainer's metrics log belongs to one run and one pass over each step, and a stop signal is always obeyed."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from dflash.train import loop
from dflash.train.checkpoints import latest_tag
from dflash.train.metrics_log import MetricsLog
from dflash.train.stop_signal import TrainingStopped
from tests import trainer_harness
from tests.scripted_clock import ScriptedClock, budget_run, scripted_steps

STEPS = 6  # budget_run: 3 steps per epoch


def test_a_stop_signal_in_the_last_step_stops_before_export_and_the_rerun_only_finishes(tmp_path, monkeypatch):
    clock = ScriptedClock()
    scripted_steps(monkeypatch, clock, lambda k: 1.0, sigterm_at=STEPS)
    with pytest.raises(TrainingStopped):
        budget_run(tmp_path, None, epochs=2)
    assert latest_tag(str(tmp_path / "checkpoints")) == f"step{STEPS}"
    trained = []
    monkeypatch.setattr(loop, "train_step", lambda *a, **k: trained.append(1))
    records = budget_run(tmp_path, None, epochs=2)  # resumes at the end: nothing left to train
    assert trained == [] and [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_resuming_drops_the_records_logged_after_the_checkpoint(tmp_path, monkeypatch):
    clock = ScriptedClock()
    scripted_steps(monkeypatch, clock, lambda k: 1.0, sigterm_at=4)
    with pytest.raises(TrainingStopped):
        budget_run(tmp_path, None, epochs=2)
    assert latest_tag(str(tmp_path / "checkpoints")) == "step4"
    # As if the run had gone on after its last checkpoint and been killed: steps 5 and 6 logged, a line torn.
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 5, "loss": -1.0}\n{"step": 6, "loss": -1.0}\n{"step": 7, "loss": 1.')
    scripted_steps(monkeypatch, clock, lambda k: 1.0)
    records = budget_run(tmp_path, None, epochs=2)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["loss"] > 0 for r in records)  # steps 5 and 6 as the resumed run trained them


def test_a_fresh_run_in_an_old_folder_keeps_none_of_its_records(tmp_path, monkeypatch):
    clock = ScriptedClock()
    scripted_steps(monkeypatch, clock, lambda k: 1.0)
    budget_run(tmp_path, None, epochs=4)  # 12 steps
    shutil.rmtree(tmp_path / "checkpoints")  # what the pipeline does when the settings changed
    records = budget_run(tmp_path, None, epochs=1)
    assert [r["step"] for r in records] == [1, 2, 3]


def test_tokens_per_s_is_measured_over_each_log_window(tmp_path, monkeypatch):
    clock = ScriptedClock()
    scripted_steps(monkeypatch, clock, lambda k: 20.0 if k == 1 else 1.0)  # a first step that compiles
    tokens = []
    real_step = loop.train_step

    def counting_step(*args, **kwargs):
        metrics = real_step(*args, **kwargs)
        tokens.append(metrics["tokens"])
        return metrics

    monkeypatch.setattr(loop, "train_step", counting_step)
    records = budget_run(tmp_path, None, epochs=2, log_every=2)
    assert [r["step"] for r in records] == [2, 4, 6]
    seconds = [21.0, 2.0, 2.0]
    for record, window_tokens, window_s in zip(records, [tokens[0:2], tokens[2:4], tokens[4:6]], seconds):
        assert record["tokens_per_s"] == pytest.approx(sum(window_tokens) / window_s)


def test_tensorboard_hides_the_steps_a_resumed_run_trains_again(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def steps_seen() -> list[int]:
        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        return [event.step for event in events.Scalars("loss")]

    log = MetricsLog(str(tmp_path), enabled=True, tensorboard=True, wandb_mode="disabled", wandb_project="t",
                     config={})
    log.resume_from(0)
    for step in range(1, 6):
        log.log(step, {"loss": float(step)})
    log.close()
    log = MetricsLog(str(tmp_path), enabled=True, tensorboard=True, wandb_mode="disabled", wandb_project="t",
                     config={})
    log.resume_from(3)
    for step in (4, 5):
        log.log(step, {"loss": 10.0 + step})
    log.close()
    assert steps_seen() == [1, 2, 3, 4, 5]
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["loss"] for line in f] == [1.0, 2.0, 3.0, 14.0, 15.0]


def test_a_log_of_another_rank_writes_nothing(tmp_path):
    log = MetricsLog(str(tmp_path), enabled=False, tensorboard=True, wandb_mode="disabled", wandb_project="t",
                     config={})
    log.resume_from(3)
    log.log(4, {"loss": torch.tensor(1.0).item()})
    log.close()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("missing,override,fix", [
    ("wandb", ["logging.wandb.mode=offline"], "logging.wandb.mode=disabled"),
    ("tensorboard", ["logging.wandb.mode=disabled"], "logging.tensorboard=false"),
])
def test_a_missing_logger_package_is_refused_before_any_stage(missing, override, fix, tmp_path, monkeypatch):
    # A machine without wandb (or tensorboard) stopped at the first line of training, after the data and capture
    # stages; now the command stops first, in one line that names the setting and both ways out.
    import importlib.util

    from dflash.config import ConfigError, compose
    from dflash.pipeline import Pipeline

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    run_dir = tmp_path / "run"
    pipeline = Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", *override]))
    with pytest.raises(ConfigError, match=f"needs the {missing} package, which is not installed.*{fix}"):
        pipeline.run()
    assert not run_dir.exists()
    # Without the train stage the loggers are not needed.
    Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}", "stages=[data]",
                      *override])).run()


def test_wandb_online_without_an_api_key_is_refused_before_any_stage(tmp_path, monkeypatch):
    # wandb.init stopped the training at its first line, after the data and capture stages ("No API key
    # configured"), or waited at a prompt for a key.
    from dflash.config import ConfigError, compose
    from dflash.pipeline import Pipeline
    from dflash.train.metrics_log import missing_wandb_credentials

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no .netrc, no wandb settings
    run_dir = tmp_path / "run"
    pipeline = Pipeline(compose(["+experiment=tiny", "show_progress=false", f"run_dir={run_dir}",
                                 "logging.wandb.mode=online"]))
    with pytest.raises(ConfigError, match=r"^logging.wandb.mode=online: no wandb API key is configured here"):
        pipeline.run()
    assert not run_dir.exists()
    # A training finished for these settings starts no logger (a rerun that evaluates again): let through.
    monkeypatch.setattr(type(pipeline.train), "done", lambda self: True)
    pipeline.train.preflight(True)
    assert missing_wandb_credentials("offline") is None
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)  # as `wandb login` leaves it (a netrc others can read is refused)
    assert missing_wandb_credentials("online") is None  # what `wandb login` writes
    (tmp_path / ".netrc").unlink()
    # A server of one's own, as `wandb login --host` records it, with its key in the .netrc.
    (tmp_path / ".config" / "wandb").mkdir(parents=True)
    (tmp_path / ".config" / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.example.com\n")
    (tmp_path / ".netrc").write_text("machine wandb.example.com\n  login user\n  password " + "0" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert missing_wandb_credentials("online") is None
    (tmp_path / ".netrc").unlink()
    assert missing_wandb_credentials("online") is not None
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert missing_wandb_credentials("online") is None


def test_the_ready_line_says_where_the_start_up_went(tmp_path, monkeypatch, caplog):
    # A fresh H100 spent 30.6 s before its first step where a rerun spent 6.3 s: the line names each phase's share.
    clock = ScriptedClock()
    scripted_steps(monkeypatch, clock, lambda k: 3.0 if k == 1 else 1.0)
    build_engine = loop.build_engine

    def slow_build(*args, **kwargs):
        clock.now += 24.0
        return build_engine(*args, **kwargs)

    monkeypatch.setattr(loop, "build_engine", slow_build)
    with caplog.at_level("INFO", logger="dflash.train.step_records"):
        budget_run(tmp_path, None, epochs=1)
    ready = [r.getMessage() for r in caplog.records if "ready after" in r.getMessage()]
    assert ready == ["[train] ready after 24.0 s (engine 24.0 s, peak matmul 0.0 s, checkpoint 0.0 s, other 0.0 s); "
                     "first step 3.0 s"]


def test_data_smaller_than_a_batch_is_said(tmp_path, monkeypatch, caplog):
    # `train.micro_batch_size=64` on the tiny experiment's 19 samples: the header said 64 sequences a step.
    scripted_steps(monkeypatch, ScriptedClock(), lambda k: 1.0)
    with caplog.at_level("WARNING", logger="dflash.train.loop"):
        budget_run(tmp_path, None, epochs=1)
    assert not [m for m in caplog.messages if "fewer than a global batch" in m]
    plan = loop.plan_batches(dataclasses.replace(trainer_harness.settings(2, 1), micro_batch_size=64), 19, 1, None)
    assert plan.steps_per_epoch == 1
    assert caplog.messages[-1] == ("[train] warning: the data holds 19 samples, fewer than a global batch of 64: each "
                                   "step trains on all 19, the rest of the batch zero-weight placeholders")


def test_one_cpu_process_starts_without_deepspeeds_shared_memory_op(tmp_path):
    # A Ctrl-C during DeepSpeed's JIT build of that op left torch's build lock file, and every later CPU training
    # waited on it for ever at its first line: one process does not build the op at all.
    import os
    import subprocess
    import sys

    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()  # a build killed midway
    code = ("from dflash.train.engine import init_distributed; print(init_distributed()); "
            "import importlib; print(importlib.import_module('deepspeed.comm.comm').cdb.shm_comm_op)")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == ["(0, 1, 0)", "None"]
