"""capture.workers=external: capture-node supervisors (two, as node 0 and node 1) run the online workers (CPU, tiny)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.extract.capture_node import node_share, node_spec, supervise
from dflash.pipeline import Pipeline

EXTERNAL = ["+experiment=tiny", "show_progress=false", "capture=online", "capture.threads=1",
            "capture.workers=external", "capture.num_workers=2", "capture.timeout_s=180",
            "stages=[data,capture,train]"]
STORED_CURVE = Path(__file__).parent / "data" / "tiny_loss_curve.json"
REPO = Path(__file__).resolve().parents[1]


def test_node_share_splits_worker_ids_evenly_or_says_why_not():
    assert [node_share(6, node, 3) for node in range(3)] == [(0, 2), (2, 2), (4, 2)]
    with pytest.raises(ValueError, match="does not split evenly over 4 capture nodes"):
        node_share(6, 0, 4)


def test_node_spec_names_the_devices_each_worker_sees(tmp_path):
    spec = {"session": "s1", "gpus_per_worker": 2, "num_workers": 4}
    on_gpus = json.loads(node_spec(spec, tmp_path / "spec.json", 1, [0, 1, 2, 3]).read_text())
    assert on_gpus["device"] == ["cuda:0", "cuda:1"] and on_gpus["session"] == "s1"
    on_cpu = json.loads(node_spec(dict(spec, gpus_per_worker=1), tmp_path / "spec.json", 0, None).read_text())
    assert on_cpu["device"] == "cpu" and (tmp_path / "spec-node0.json").is_file()


def test_a_supervisor_started_after_its_session_ended_starts_no_workers(tmp_path):
    # A late start or a requeue after training: done.json names the spec's session, so there is nothing to do.
    spec = {"session": "s1", "gpus_per_worker": 1, "num_workers": 2, "log_dir": str(tmp_path / "logs"),
            "stale_after_s": 60}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "done.json").write_text(json.dumps({"session": "s1"}))
    assert supervise(tmp_path / "spec.json", 0, 1, None, wait_s=5.0, poll_s=0.01) == 0
    assert not (tmp_path / "logs").exists()  # no worker was started


def test_a_restarted_trainer_frees_the_item_files_of_the_nodes_old_workers(tmp_path, monkeypatch):
    """When the trainer starts a new session, the supervisor stops its workers and deletes their shares of the old
    session's spool: nobody reads them any more, and each restart would otherwise keep up to a spool budget."""
    import threading

    from dflash.extract import capture_node

    class FakePool:  # the supervisor's view of its workers, without processes
        def __init__(self, *args, **kwargs):
            self.killed = False

        def start(self):
            pass

        def kill(self):
            self.killed = True

        def failed(self):
            return None

        def join(self, timeout_s):
            pass

    monkeypatch.setattr(capture_node, "WorkerPool", FakePool)
    spec_path = tmp_path / "logs" / "spec.json"
    spec_path.parent.mkdir()

    def start(session: str) -> Path:
        spool = tmp_path / f"session-{session}"
        for worker in (0, 1):  # node 1 of 2 runs worker 1 only
            (spool / "data" / f"w{worker}").mkdir(parents=True)
            (spool / "data" / f"w{worker}" / "i000000000001.safetensors").write_bytes(b"x")
        spec_path.write_text(json.dumps({"session": session, "spool": str(spool), "num_workers": 2,
                                         "gpus_per_worker": 1, "log_dir": str(tmp_path / "logs"),
                                         "stale_after_s": 1}))
        return spool

    old = start("a")
    result: list[int] = []
    supervisor = threading.Thread(target=lambda: result.append(
        supervise(spec_path, 1, 2, None, wait_s=30, poll_s=0.01)))
    supervisor.start()
    time.sleep(0.3)
    new = start("b")
    time.sleep(0.3)
    (tmp_path / "logs" / "done.json").write_text(json.dumps({"session": "b"}))
    supervisor.join(timeout=30)
    assert result == [0]
    assert not (old / "data" / "w1").exists()  # this node's share of the old session: freed
    assert (old / "data" / "w0").exists()  # node 0's: its own supervisor frees it
    assert (new / "data" / "w1" / "i000000000001.safetensors").exists()  # the running session's: kept


@pytest.mark.parametrize("override, message", [
    ("capture.num_workers=null", "capture.num_workers=None: expected the number of workers"),
    ("capture.gpus_per_worker=auto", "capture.gpus_per_worker='auto': expected an int"),
])
def test_external_workers_need_a_worker_count_and_gpus_per_worker(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(compose(EXTERNAL + [f"run_dir={tmp_path}", override]))


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_capture_nodes_stream_the_features_of_the_offline_run(tmp_path):
    run_dir = tmp_path / "run"
    Pipeline(compose(EXTERNAL + [f"run_dir={run_dir}", "stages=[data]"])).run()
    spec = run_dir / "capture_logs" / "spec.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    logs = [open(tmp_path / f"node{n}.log", "wb") for n in range(2)]  # noqa: SIM115
    # The supervisors start first and wait for the trainer's spec, as capture jobs scheduled early would.
    nodes = [subprocess.Popen([sys.executable, "-m", "dflash.extract.capture_node", str(spec), "--wait-s", "300"],
                              env={**env, "RANK": str(n)}, stdout=logs[n], stderr=subprocess.STDOUT, cwd=REPO)
             for n in range(2)]
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            Pipeline(compose(EXTERNAL + [f"run_dir={run_dir}"])).run()
        codes = [node.wait(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill() if node.poll() is None else None
        for log in logs:
            log.close()
    node_logs = [(tmp_path / f"node{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], node_logs
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        losses = [json.loads(line)["loss"] for line in f]
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(stored), rtol=2e-4, atol=2e-4)
    assert "workers 0..0" in node_logs[0] and "workers 1..1" in node_logs[1]
    assert not (run_dir / "spool").exists() and "external capture worker" in printed.getvalue()
    report = json.loads((run_dir / "capture_logs" / "throughput.json").read_text())
    assert report["capture_devices"] == 2 and report["capture_tokens_per_s_per_device"] > 0
    shutil.rmtree(run_dir)


@pytest.mark.multiproc
@pytest.mark.slow
def test_capture_nodes_follow_a_trainer_that_was_killed_and_started_again(tmp_path):
    run_dir = tmp_path / "run"
    Pipeline(compose(EXTERNAL + [f"run_dir={run_dir}", "stages=[data]"])).run()
    spec = run_dir / "capture_logs" / "spec.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0"}
    with open(tmp_path / "node.log", "wb") as log:
        node = subprocess.Popen([sys.executable, "-m", "dflash.extract.capture_node", str(spec), "--wait-s", "300"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    with open(tmp_path / "trainer.log", "wb") as log:
        trainer = subprocess.Popen([sys.executable, "-m", "dflash.train", *EXTERNAL, f"run_dir={run_dir}",
                                    "capture.num_workers=1"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        metrics = run_dir / "metrics.jsonl"
        for _ in range(1500):  # killed once it has trained a step, with features in flight
            if metrics.exists() and metrics.read_text().count("\n") >= 1 or trainer.poll() is not None:
                break
            time.sleep(0.2)
        trainer.kill()
        assert trainer.wait() == -9, (tmp_path / "trainer.log").read_text()[-3000:]
        first_session = json.loads(spec.read_text())["session"]
        with contextlib.redirect_stdout(io.StringIO()):
            Pipeline(compose(EXTERNAL + [f"run_dir={run_dir}", "capture.num_workers=1"])).run()
        assert node.wait(timeout=120) == 0
    finally:
        for process in (node, trainer):
            process.kill() if process.poll() is None else None
    log_text = (tmp_path / "node.log").read_text()
    assert json.loads(spec.read_text())["session"] != first_session
    assert "the trainer restarted" in log_text and "done" in log_text, log_text
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        losses = [json.loads(line)["loss"] for line in f]
    stored = json.loads(STORED_CURVE.read_text())["loss"]
    # No checkpoint was saved before the kill, so the second start trains from step 1 again.
    torch.testing.assert_close(torch.tensor(losses[-len(stored):]), torch.tensor(stored), rtol=2e-4, atol=2e-4)
