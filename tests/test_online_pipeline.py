"""`capture=online` in the pipeline: capture workers started by the train stage stream the features (CPU, tiny)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.pipeline import Pipeline

ONLINE = ["+experiment=tiny", "show_progress=false", "capture=online", "capture.threads=1",
          "stages=[data,capture,train]"]
STORED_CURVE = Path(__file__).parent / "data" / "tiny_loss_curve.json"
REPO = Path(__file__).resolve().parents[1]


def losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["loss"] for line in f]


def worker_pids(run_dir: Path) -> list[int]:
    """Live capture worker processes of this run (found by the spec path on their command line)."""
    spec, found = str(run_dir / "capture_logs" / "spec.json"), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if spec.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The tiny data stage, built once and copied into every run of this file (its fingerprint is path-free)."""
    run_dir = tmp_path_factory.mktemp("online-data")
    Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "stages=[data]"])).run()
    return run_dir / "data"


def new_run(tmp_path: Path, data_dir: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(data_dir, run_dir / "data")
    return run_dir


@pytest.fixture(scope="module")
def online_run(tmp_path_factory, data_dir) -> tuple[Path, str]:
    run_dir = new_run(tmp_path_factory.mktemp("online"), data_dir)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        Pipeline(compose(ONLINE + [f"run_dir={run_dir}"])).run()
    return run_dir, out.getvalue()


@pytest.mark.multiproc
@pytest.mark.slow
def test_online_run_trains_the_offline_losses_and_leaves_nothing_behind(online_run):
    run_dir, printed = online_run
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(stored), rtol=2e-4, atol=2e-4)
    assert not (run_dir / "spool").exists()  # every item consumed and deleted, then the spool removed
    assert not (run_dir / "features" / "manifest.json").exists()  # no feature store was written
    assert (run_dir / "features" / "frozen_head.safetensors").exists() and (run_dir / "export" / "done.json").exists()
    assert worker_pids(run_dir) == []
    report = json.loads((run_dir / "capture_logs" / "throughput.json").read_text())
    assert report["capture_tokens_per_s_per_device"] > 0 and report["trainer_tokens_per_s_per_rank"] > 0
    assert sum(report["balanced_split"]) == 2 and min(report["balanced_split"]) >= 1
    assert "balanced capture:trainer device split" in printed


PARENT = """
import sys, time
from dflash.extract.online_workers import WorkerPool
pool = WorkerPool(sys.argv[1], 1, sys.argv[2])
pool.start()
print(pool.processes[0].pid, flush=True)
time.sleep(600)
"""


@pytest.mark.multiproc
def test_workers_exit_when_their_trainer_is_sigkilled(online_run, tmp_path):
    run_dir, _ = online_run
    spec = json.loads((run_dir / "capture_logs" / "spec.json").read_text())
    spec.update(spool=str(tmp_path / "spool"), log_dir=str(tmp_path / "logs"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "spec.json"), str(tmp_path / "logs")],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE)
    worker = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not any((tmp_path / "spool" / "data" / "w0").glob("i*.safetensors")):  # the worker is streaming
        assert time.monotonic() < deadline, "the capture worker wrote nothing"
        time.sleep(0.05)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 15
    while Path(f"/proc/{worker}").exists() and "Z" not in Path(f"/proc/{worker}/stat").read_text().split(")")[-1][:3]:
        assert time.monotonic() < deadline, "the capture worker outlived its SIGKILLed trainer"
        time.sleep(0.1)


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_workers_one_killed_lose_no_sample(tmp_path, data_dir, monkeypatch):
    import dflash.train.loop as loop

    run_dir, real_train, killed = new_run(tmp_path, data_dir), loop.train, []

    def train_after_killing_the_worker(settings, config, store, *args, **kwargs):
        # Wait for worker 0's first item (it is then mid-stream), SIGKILL it, and train as usual.
        spool = run_dir / "spool" / "data" / "w0"
        deadline = time.monotonic() + 60
        while not any(spool.glob("i*.safetensors")):
            assert time.monotonic() < deadline, "capture worker 0 wrote nothing"
            time.sleep(0.02)
        pids = worker_pids(run_dir)
        assert len(pids) == 2
        spec = str(run_dir / "capture_logs" / "spec.json").encode()
        argv = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in pids}
        (pid,) = [p for p in pids if argv[p][argv[p].index(spec) + 1] == b"0"]  # SPEC WORKER_ID PARENT_PID
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        return real_train(settings, config, store, *args, **kwargs)

    monkeypatch.setattr(loop, "train", train_after_killing_the_worker)
    # A small budget keeps both workers waiting on the trainer, so neither can finish before the kill.
    Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "capture.chunk_items=4", "capture.num_workers=2",
                              "capture.budget_bytes=1000000"])).run()
    assert killed
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(stored), rtol=2e-4, atol=2e-4)
    assert not (run_dir / "spool").exists() and worker_pids(run_dir) == []


@pytest.mark.multiproc
def test_a_failing_trainer_stops_its_workers(tmp_path, data_dir, monkeypatch):
    import dflash.train.loop as loop

    run_dir = new_run(tmp_path, data_dir)

    def failing_train(settings, config, store, *args, **kwargs):
        store[store.stream.item(0)[1]]  # the workers are up and streaming
        assert worker_pids(run_dir)
        raise RuntimeError("trainer crashed")

    monkeypatch.setattr(loop, "train", failing_train)
    with pytest.raises(RuntimeError, match="trainer crashed"):
        # A small spool and no cache: the workers cannot finish the stream (and exit) before the check above.
        Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "capture.chunk_items=4", "capture.budget_bytes=1000000",
                                  "capture.cache=false"])).run()
    assert worker_pids(run_dir) == []
    assert not (run_dir / "export" / "done.json").exists()


@pytest.mark.multiproc
@pytest.mark.slow
def test_workers_that_keep_dying_stop_the_trainer_with_their_error(tmp_path, data_dir):
    run_dir = new_run(tmp_path, data_dir)
    # A budget too small for one chunk: every worker life fails at start-up with a clear message.
    overrides = [f"run_dir={run_dir}", "capture.budget_bytes=1000", "capture.max_restarts=1"]
    with pytest.raises(RuntimeError, match="died 2 times(.|\n)*share of the spool budget"):
        Pipeline(compose(ONLINE + overrides)).run()
    assert worker_pids(run_dir) == []


@pytest.mark.multiproc
@pytest.mark.parametrize("group_by", ["tokens", "work"])
@pytest.mark.slow
def test_length_grouped_batches_train_the_same_online_colocated_and_offline(tmp_path, data_dir, group_by):
    # The online workers compute the grouping keys themselves: any difference from the trainer's would deal
    # other batches (their plan digests are compared) or train other losses.
    base = ["+experiment=tiny", "show_progress=false", "stages=[data,capture,train]", "train.group_by_length=2",
            f"train.group_by={group_by}"]
    modes = {"offline": ["capture=offline"], "colocated": ["capture=colocated"],
             "online": ["capture=online", "capture.threads=1"]}
    curves = {}
    for mode, overrides in modes.items():
        (tmp_path / mode).mkdir()
        run_dir = new_run(tmp_path / mode, data_dir)
        with contextlib.redirect_stdout(io.StringIO()):
            Pipeline(compose(base + overrides + [f"run_dir={run_dir}"])).run()
        curves[mode] = torch.tensor(losses(run_dir))
    stored = torch.tensor(json.loads(STORED_CURVE.read_text())["loss"])
    assert not torch.allclose(curves["offline"], stored)  # grouping changed which samples share a batch
    torch.testing.assert_close(curves["online"], curves["offline"], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(curves["colocated"], curves["offline"], rtol=2e-4, atol=2e-4)


def test_capture_compile_reaches_the_workers(online_run, monkeypatch):
    """capture.compile travels in the workers' spec, and a worker compiles its target's layers before capturing."""
    from dflash.extract import online_workers
    from dflash.models.targets import compile_target

    run_dir, _ = online_run
    spec = json.loads((run_dir / "capture_logs" / "spec.json").read_text())
    assert spec["compile"] is False

    class Compiled(Exception):
        pass

    def compile_layers(adapter):
        raise Compiled(adapter.num_layers)

    monkeypatch.setattr(compile_target, "compile_target_layers", compile_layers)
    with pytest.raises(Compiled):
        online_workers.run_worker(dict(spec, compile=True), 0)
