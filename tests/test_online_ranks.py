"""capture=online in the pipeline: one job on CPU (gloo) whose last ranks capture for the others, on the tiny target.
The losses equal the stored offline curve with 1 or 2 capture ranks and 1 or 2 trainer ranks (2 trainer ranks of 2
samples keep the global batch of 4), length-grouped batches and a step cap train what offline capture trains, and a
job whose capture rank or trainer rank is SIGKILLed mid-run is restarted by torchrun (--max-restarts 1) and resumes
from its last checkpoint to the same losses: no micro-batch lost or used twice."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.pipeline import Pipeline, run_command
from tests.forked import run_ranks
from tests.test_rank_stream import free_port

ONLINE = ["+experiment=tiny", "show_progress=false", "capture=online"]
STORED_CURVE = Path(__file__).parent / "data" / "tiny_loss_curve.json"
CHILD = Path(__file__).parent / "online_ranks_child.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The tiny data stage, built once and copied into every run of this file (its fingerprint is path-free)."""
    run_dir = tmp_path_factory.mktemp("online-ranks-data")
    Pipeline(compose(ONLINE + [f"run_dir={run_dir}", "stages=[data]"])).run()
    return run_dir / "data"


def forked_rank(console: str, overrides: list[str]) -> None:
    """A rank of run_job's job when it kills no rank (tests/forked.py's run_ranks): the pipeline command, its console
    into CONSOLE-rankR.out and .err."""
    for descriptor, name in ((1, "out"), (2, "err")):
        with open(f"{console}-rank{os.environ['RANK']}.{name}", "w", encoding="utf-8") as file:
            os.dup2(file.fileno(), descriptor)
    run_command(compose(overrides))


def run_job(run_dir: Path, data_dir: Path, captures: int, trainers: int, point: str = "none",
            extra: tuple[str, ...] = (), nodes: int = 1) -> subprocess.CompletedProcess:
    """One job of captures + trainers ranks, launched by torchrun when a rank is to be killed (and restarted) or when
    it spans nodes: with nodes > 1, one torchrun per node (static rendezvous on this machine), each node's last
    captures / nodes ranks capturing (capture.ranks_per_node)."""
    run_dir.mkdir()
    shutil.copytree(data_dir, run_dir / "data")
    overrides = ONLINE + [f"run_dir={run_dir}", "stages=[data,capture,train]", f"capture.ranks={captures}",
                          f"train.micro_batch_size={4 // trainers}", *extra]
    if nodes > 1:
        overrides.append(f"capture.ranks_per_node={captures // nodes}")
    if point == "none" and nodes == 1:
        # No rank killed, so no restart to ask of torchrun: the ranks fork from a server that imported dflash once
        # (tests/forked.py), where torchrun's processes would each import it again, most of these tests' time.
        console = f"{run_dir}-console"
        codes = run_ranks(forked_rank, captures + trainers, console, overrides)
        outputs = [[Path(f"{console}-rank{rank}.{name}").read_text() for name in ("out", "err")]
                   for rank in range(captures + trainers)]
        return subprocess.CompletedProcess("forked", max(abs(code) for code in codes),
                                           "".join(out for out, _ in outputs), "".join(err for _, err in outputs))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
         "--nproc_per_node", str((captures + trainers) // nodes), "--master_addr", "127.0.0.1", "--master_port",
         str(port), "--max-restarts", "0" if point == "none" else "1", str(CHILD), point, *overrides],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(nodes)]
    outputs = [launch.communicate(timeout=400) for launch in launches]
    return subprocess.CompletedProcess(
        [launch.args for launch in launches], max(launch.returncode for launch in launches),
        "".join(out for out, _ in outputs), "".join(err for _, err in outputs))


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # each step logged once
    return [r["loss"] for r in records]


def assert_offline_losses(run_dir: Path, job: subprocess.CompletedProcess, stored: list[float] | None = None) -> None:
    """The job ended well and trained `stored` (default: the stored offline curve of the tiny run)."""
    assert job.returncode == 0, job.stderr[-4000:]
    stored = stored if stored is not None else json.loads(STORED_CURVE.read_text())["loss"]
    torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(stored), rtol=2e-4, atol=2e-4)


def in_process(run_dir: Path, data_dir: Path, capture: str, *extra: str) -> list[float]:
    """The losses of the same run with capture=offline or colocated, in this process."""
    run_dir.mkdir()
    shutil.copytree(data_dir, run_dir / "data")
    overrides = ["+experiment=tiny", "show_progress=false", f"capture={capture}", f"run_dir={run_dir}",
                 "stages=[data,capture,train]", *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        Pipeline(compose(overrides)).run()
    return losses(run_dir)


@pytest.mark.parametrize("captures,trainers,cache", [(1, 1, "false"), (2, 2, "true")])
def test_capture_ranks_feed_trainer_ranks_the_offline_losses(tmp_path, data_dir, captures, trainers, cache):
    """With capture.cache=true the capture ranks make the first of the 3 epochs only; the trainer ranks keep its
    samples and read the later epochs back (the same losses)."""
    run_dir = tmp_path / "run"
    job = run_job(run_dir, data_dir, captures, trainers, extra=(f"capture.cache={cache}",))
    assert_offline_losses(run_dir, job)
    steps = len(json.loads(STORED_CURVE.read_text())["loss"])
    sent = sum(int(n) for n in re.findall(r"sent (\d+) micro-batches", job.stdout))
    assert sent == steps * trainers // (3 if cache == "true" else 1), job.stdout[-3000:]
    assert json.loads((run_dir / "capture_logs" / "cache.json").read_text())["cache"] == (cache == "true")
    throughput = json.loads((run_dir / "capture_logs" / "throughput.json").read_text())
    assert throughput["capture_devices"] == captures and throughput["trainer_ranks"] == trainers
    assert throughput["capture_tokens_per_s_per_device"] > 0 and throughput["trainer_tokens_per_s_per_rank"] > 0
    assert sum(throughput["balanced_split"]) == captures + trainers and min(throughput["balanced_split"]) >= 1
    assert not (run_dir / "features" / "manifest.json").exists()  # no feature store was written
    assert "balanced capture:trainer device split" in job.stdout
    # A capture rank's lines reach the console once and its own log file in the run folder.
    sent = [line for line in job.stdout.splitlines() if "sent" in line and "micro-batches" in line]
    assert len(sent) == captures, job.stdout[-3000:]
    assert len(list((run_dir / "logs").glob("*-capture-rank*.log"))) == captures


def test_on_two_nodes_every_nodes_capture_rank_feeds_its_trainer_the_offline_losses(tmp_path, data_dir):
    """Two torchrun nodes on this machine, 1 trainer + 1 capture rank each (capture.ranks_per_node=1): job ranks 0
    (trainer 0), 1 (capture), 2 (trainer 1), 3 (capture); each capture rank serves its node's trainer only, the
    first epoch's samples kept in the shared feature cache."""
    run_dir = tmp_path / "run"
    job = run_job(run_dir, data_dir, 2, 2, extra=("capture.cache=true",), nodes=2)
    assert_offline_losses(run_dir, job)
    steps = len(json.loads(STORED_CURVE.read_text())["loss"])
    sent = sorted(int(n) for n in re.findall(r"sent (\d+) micro-batches", job.stdout))
    assert sent == [steps // 3, steps // 3], job.stdout[-3000:]  # the first epoch of its node's trainer each
    assert sorted(path.name.split("-")[-1] for path in (run_dir / "logs").glob("*-capture-rank*.log")) == \
        ["rank1.log", "rank3.log"]


@pytest.mark.parametrize("group_by", ["tokens", "work"])
def test_length_grouped_batches_train_the_same_online_colocated_and_offline(tmp_path, data_dir, group_by):
    """The capture ranks compute the grouping keys themselves: any difference from the trainers' would deal other
    batches (their plan digests are compared) or train other losses."""
    grouped = ("train.group_by_length=2", f"train.group_by={group_by}")
    offline = in_process(tmp_path / "offline", data_dir, "offline", *grouped)
    assert not torch.allclose(torch.tensor(offline), torch.tensor(json.loads(STORED_CURVE.read_text())["loss"]))
    assert_offline_losses(tmp_path / "online", run_job(tmp_path / "online", data_dir, 1, 1, extra=grouped), offline)
    colocated = in_process(tmp_path / "colocated", data_dir, "colocated", *grouped)
    torch.testing.assert_close(torch.tensor(colocated), torch.tensor(offline), rtol=2e-4, atol=2e-4)


def test_a_step_cap_ends_the_stream_early_with_the_offline_losses(tmp_path, data_dir):
    """train.max_steps stops the trainers mid-epoch: they take the micro-batches they asked for and stop the capture
    ranks, which end without sending the rest."""
    offline = in_process(tmp_path / "offline", data_dir, "offline", "train.max_steps=5")
    job = run_job(tmp_path / "online", data_dir, 1, 2, extra=("train.max_steps=5", "capture.cache=false"))
    assert len(offline) == 5
    assert_offline_losses(tmp_path / "online", job, offline)
    [sent] = [int(n) for n in re.findall(r"sent (\d+) micro-batches", job.stdout)]
    assert 5 * 2 <= sent < len(json.loads(STORED_CURVE.read_text())["loss"]) * 2, job.stdout[-3000:]


@pytest.mark.parametrize("point,captures,trainers", [("capture", 2, 1), ("trainer", 1, 2)])
def test_a_sigkilled_rank_restarts_the_job_which_resumes_exactly(tmp_path, data_dir, point, captures, trainers):
    run_dir = tmp_path / "run"
    job = run_job(run_dir, data_dir, captures, trainers, point, extra=("train.save_every=2",))
    killed = {"capture": trainers, "trainer": 0}[point]  # the first capture rank's job rank, or trainer rank 0
    assert (run_dir / f"killed-{killed}").exists(), job.stderr[-4000:]
    assert_offline_losses(run_dir, job)


def test_trainer_rank_0_failing_before_the_stream_is_the_error_every_rank_names(tmp_path, data_dir):
    """A refusal on trainer rank 0 after the data stage (capture.cache=true over its budget): it prints its one line,
    and the other trainer and the capture rank end naming it, not with a symptom of the missing stream (the second
    trainer read the start of a stream that did not exist: TypeError)."""
    job = run_job(tmp_path / "run", data_dir, 1, 2, extra=("capture.cache=true", "capture.cache_budget_bytes=1"))
    assert job.returncode != 0
    assert "dflash: error: capture.cache=true: one epoch of features takes" in job.stderr
    # Here job rank 0 holds the store (no torchrun agent), so a rank may find it gone before it reads the reason.
    for rank in (1, 2):  # the other trainer rank, the capture rank
        last = Path(f"{tmp_path / 'run'}-console-rank{rank}.err").read_text().strip().splitlines()[-1]
        assert last.startswith(("RuntimeError: trainer rank 0 stopped before the feature stream started: "
                                "ConfigError: capture.cache=true", "RuntimeError: the job's store went away")), last
