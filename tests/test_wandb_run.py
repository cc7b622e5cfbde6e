"""A training's wandb run: an online training resumed after a stop continues its run, rewound to the step it resumes
from; an offline one (wandb resumes no offline run) starts a run per start; the closing block names the online page."""

from __future__ import annotations

import json
import logging

import pytest

from dflash.stages.export import logger_rows
from dflash.train.metrics_log import WANDB_RUN_ID, MetricsLog

wandb = pytest.importorskip("wandb")


class FakeRun:
    def __init__(self, run_id: str, mode: str) -> None:
        self.id, self.url = run_id, f"https://wandb.example/runs/{run_id}" if mode == "online" else None

    def log(self, values, step):
        pass

    def finish(self):
        pass


def fake_wandb(monkeypatch, refuse: tuple[str, ...] = ()) -> list[dict]:
    """wandb.init replaced: each call's arguments, in order; a new run's id is r<call number>, a continued run keeps
    its id; `refuse` names the ways of continuing wandb's site refuses ("resume_from", "resume")."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if kwargs.get("resume_from"):
            if "resume_from" in refuse:
                raise RuntimeError("rewinding is not enabled")
            return FakeRun(kwargs["resume_from"].split("?")[0], kwargs["mode"])
        if kwargs.get("resume"):
            if "resume" in refuse:
                raise RuntimeError("run r1 not found")
            return FakeRun(kwargs["id"], kwargs["mode"])
        return FakeRun(f"r{len(calls)}", kwargs["mode"])

    monkeypatch.setattr(wandb, "init", init)
    return calls


def start(run_dir, mode, step):
    log = MetricsLog(str(run_dir), enabled=True, tensorboard=False, wandb_mode=mode, wandb_project="p", config={})
    log.resume_from(step)
    log.log(step + 1, {"loss": 1.0})
    log.close()


def recorded(run_dir):
    return json.loads((run_dir / WANDB_RUN_ID).read_text())


def test_an_online_training_resumed_continues_its_run_from_the_step_it_resumes_from(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    start(tmp_path, "online", 0)
    assert "resume_from" not in calls[0] and calls[0]["dir"] == str(tmp_path)
    assert recorded(tmp_path) == {"id": "r1", "mode": "online", "url": "https://wandb.example/runs/r1"}
    start(tmp_path, "online", 40)  # killed after its checkpoint of step 40, started again
    assert calls[1]["resume_from"] == "r1?_step=40" and "id" not in calls[1]
    assert recorded(tmp_path)["id"] == "r1"
    assert ("wandb", "https://wandb.example/runs/r1") in logger_rows(str(tmp_path))


def test_without_rewinding_the_run_is_continued_where_it_stopped(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch, refuse=("resume_from",))
    start(tmp_path, "online", 0)
    start(tmp_path, "online", 40)
    assert calls[2]["id"] == "r1" and calls[2]["resume"] == "allow" and recorded(tmp_path)["id"] == "r1"


def test_a_run_wandb_will_not_continue_gives_a_new_run_and_says_so(tmp_path, monkeypatch, caplog):
    calls = fake_wandb(monkeypatch, refuse=("resume_from", "resume"))
    start(tmp_path, "online", 0)
    with caplog.at_level(logging.WARNING, logger="dflash"):
        start(tmp_path, "online", 40)
    assert "wandb could not continue run r1 at step 40 (run r1 not found)" in caplog.text
    assert [("resume_from" in kw, "resume" in kw) for kw in calls] == [(False, False), (True, False), (False, True),
                                                                       (False, False)]
    assert recorded(tmp_path)["id"] == "r4"  # the next start continues the new run


def test_offline_each_start_is_a_run_of_its_own(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    start(tmp_path, "offline", 0)
    start(tmp_path, "offline", 40)
    assert not any("resume_from" in kw for kw in calls) and recorded(tmp_path)["mode"] == "offline"
    start(tmp_path, "online", 80)  # an offline run was never on wandb's site: online starts a new run there
    assert not {"resume_from", "resume"} & set(calls[2]) and recorded(tmp_path) == {
        "id": "r3", "mode": "online", "url": "https://wandb.example/runs/r3"}


def test_wandb_opens_no_run_while_no_training_has_started(tmp_path, monkeypatch):
    """A training that fails before it knows its first step (engine, checkpoint) leaves no wandb run."""
    calls = fake_wandb(monkeypatch)
    log = MetricsLog(str(tmp_path), enabled=True, tensorboard=False, wandb_mode="online", wandb_project="p",
                     config={})
    log.close()
    assert calls == [] and not (tmp_path / "wandb").exists()


def test_a_torn_run_id_file_starts_a_new_run(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    (tmp_path / "wandb").mkdir()
    (tmp_path / WANDB_RUN_ID).write_text('{"id": "r0", "mo')
    start(tmp_path, "online", 40)
    assert "resume_from" not in calls[0] and recorded(tmp_path)["id"] == "r1"
