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
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from dflash.config import compose
from dflash.pipeline import Pipeline, run_command
from tests.forked import run_ranks
from tests.test_trainer import held_rendezvous

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
            extra: tuple[str, ...] = (), nodes: int = 1, restarts: int | None = None) -> subprocess.CompletedProcess:
    """One job of captures + trainers ranks, launched by torchrun when a rank is to be killed (and restarted), when
    it may restart (`restarts`: --max-restarts; 1 when a rank is killed) or when it spans nodes: with nodes > 1, one
    torchrun per node (static rendezvous on this machine), each node's last captures / nodes ranks capturing
    (capture.ranks_per_node)."""
    overrides = job_overrides(run_dir, data_dir, captures, trainers, extra, nodes)
    if point == "none" and nodes == 1 and restarts is None:
        # No rank killed, so no restart to ask of torchrun: the ranks fork from a server that imported dflash once
        # (tests/forked.py), where torchrun's processes would each import it again, most of these tests' time.
        console = f"{run_dir}-console"
        codes = run_ranks(forked_rank, captures + trainers, console, overrides)
        outputs = [[Path(f"{console}-rank{rank}.{name}").read_text() for name in ("out", "err")]
                   for rank in range(captures + trainers)]
        return subprocess.CompletedProcess("forked", max(abs(code) for code in codes),
                                           "".join(out for out, _ in outputs), "".join(err for _, err in outputs))
    restarts = restarts if restarts is not None else 0 if point == "none" else 1
    with held_rendezvous() as rendezvous:
        launches = torchrun_job(overrides, captures + trainers, point, nodes, restarts, rendezvous["MASTER_PORT"])
        outputs = [launch.communicate(timeout=400) for launch in launches]
    return subprocess.CompletedProcess(
        [launch.args for launch in launches], max(launch.returncode for launch in launches),
        "".join(out for out, _ in outputs), "".join(err for _, err in outputs))


def job_overrides(run_dir: Path, data_dir: Path, captures: int, trainers: int, extra: tuple[str, ...],
                  nodes: int = 1) -> list[str]:
    """The command of run_job's ranks, in a new run folder holding the tiny data stage."""
    run_dir.mkdir()
    shutil.copytree(data_dir, run_dir / "data")
    overrides = ONLINE + [f"run_dir={run_dir}", "stages=[data,capture,train]", f"capture.ranks={captures}",
                          f"train.micro_batch_size={4 // trainers}", *extra]
    if nodes > 1:
        overrides.append(f"capture.ranks_per_node={captures // nodes}")
    return overrides


def torchrun_job(overrides: list[str], ranks: int, point: str, nodes: int, restarts: int,
                 port: str) -> list[subprocess.Popen]:
    """The torchrun launches (one a node) of a job of `ranks` ranks running tests/online_ranks_child.py, under a run id
    of its own (TORCHELASTIC_RUN_ID: what a restarted start finds an earlier start's ending by,
    dflash/stages/job_ending.py). They meet by torchrun's c10d rendezvous in the store at `port` that the test holds
    (held_rendezvous), every agent its client: a port found free and handed on could be taken meanwhile."""
    job = f"test-{uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", str(ranks // nodes),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false",
         "--rdzv_id", job, "--max-restarts", str(restarts), str(CHILD), point, *overrides],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for _ in range(nodes)]


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


def test_a_user_error_ends_the_job_at_its_first_start_though_torchrun_may_restart_it(tmp_path, data_dir):
    """Trainer rank 0 refuses the cache's budget at the stream's start; its restarted start stops before the ranks
    meet (the target is not loaded again), printing one line that names the earlier start's error."""
    run_dir = tmp_path / "run"
    job = run_job(run_dir, data_dir, 1, 1, extra=("capture.cache=true", "capture.cache_budget_bytes=1"), restarts=1)
    assert job.returncode != 0
    assert job.stderr.count("dflash: error: capture.cache=true: one epoch of features takes") == 1, job.stderr[-4000:]
    assert job.stderr.count("dflash: error: an earlier start of this job (torchrun run test-") == 1, job.stderr[-4000:]
    assert "exitcode  : 2 " in job.stderr  # the restarted start's ranks end with the error's status
    assert len(list((run_dir / "logs").glob("*-capture-rank*.log"))) == 1  # no capture rank served again


def wait_for(launch: subprocess.Popen, *paths: Path) -> None:
    """Until every path exists; AssertionError with the job's output if it ended first."""
    deadline = time.monotonic() + 300
    while not all(path.exists() for path in paths):
        if launch.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):  # torchrun and its ranks (a session of their own)
                os.killpg(launch.pid, signal.SIGKILL)
            out, err = launch.communicate()
            raise AssertionError(f"{[p.name for p in paths if not p.exists()]} not written\n{out[-3000:]}{err[-4000:]}")
        time.sleep(0.1)


def test_a_sigterm_to_torchrun_finishes_the_step_saves_it_and_ends_every_rank_without_a_restart(tmp_path, data_dir):
    """What SLURM, `timeout` and Kubernetes do. The capture rank holds the third step's micro-batch and trainer rank
    0 waits for it when torchrun is told to stop, and both go on only once their handler ran: the capture rank keeps
    serving, the trainer finishes the step, saves it and stops (143), and the capture rank ends once the trainer is
    gone (143). torchrun itself ends on the signal, restarting nothing."""
    run_dir = tmp_path / "run"
    overrides = job_overrides(run_dir, data_dir, 1, 1, ("capture.cache=false", "capture.batch_tokens=1"))
    with held_rendezvous() as rendezvous:
        [launch] = torchrun_job(overrides, 2, "sigterm", 1, 1, rendezvous["MASTER_PORT"])
        wait_for(launch, run_dir / "held-capture", run_dir / "held-trainer")
        launch.send_signal(signal.SIGTERM)  # torchrun sends it on to its ranks
        wait_for(launch, run_dir / "signalled-0", run_dir / "signalled-1")
        (run_dir / "go").write_text("")
        out, err = launch.communicate(timeout=400)
    assert launch.returncode != 0  # torchrun's own status on a signal
    assert "[train] training stopped by SIGTERM after step 3; a checkpoint of step 3 was saved" in out, err[-4000:]
    assert "[online] capture rank 1 stopped by SIGTERM once the trainer ranks had stopped" in out, err[-4000:]
    assert len(losses(run_dir)) == 3 and (run_dir / "checkpoints" / "step3").is_dir()
    assert len(list((run_dir / "logs").glob("*-capture-rank*.log"))) == 1  # one start
    assert not (run_dir / "logs" / "job-ending.json").exists()  # a stop is not an ending a restart would repeat

