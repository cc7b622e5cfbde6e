"""launch/detached_job.sh: a job started by one call runs on after it, in its own copy of the repository, and later
calls wait for it and bring back its log and its run's small files (the export in parts that join again)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def make_repository(root: Path) -> Path:
    """A stand-in repository: the script, a file the job reads, and the carried folders it must not copy."""
    (root / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "detached_job.sh", root / "launch" / "detached_job.sh")
    (root / "marker.txt").write_text("code of this call\n")
    for carried in (".stage/part-1", ".whl-a"):
        (root / carried).mkdir(parents=True)
        (root / carried / "big").write_bytes(bytes(1000))
    return root


def job(root: Path, env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "launch" / "detached_job.sh"), *args], env=env, capture_output=True,
                          text=True, check=check, timeout=60)


def environment(tmp_path: Path) -> dict:
    return {**os.environ, "JOBS": str(tmp_path / "jobs"), "OUT": str(tmp_path / "out")}


def test_the_job_outlives_its_call_in_its_own_copy_and_a_later_call_sees_how_it_ended(tmp_path):
    root = make_repository(tmp_path / "repo")
    env = environment(tmp_path)
    go = tmp_path / "go"
    script = f'cat marker.txt; python3 -c "import sys; print(sys.path[1])"; while [ ! -f {go} ]; do sleep 0.05; done'
    job(root, env, "start", "demo", "bash", "-c", script + "; exit 3")
    # The call that started it has returned and the job still runs, waiting for the flag.
    copy = tmp_path / "jobs" / "demo" / "repo"
    assert not (tmp_path / "jobs" / "demo" / "exit").exists()
    assert (copy / "marker.txt").exists() and not (copy / ".stage").exists() and not (copy / ".whl-a").exists()
    (root / "marker.txt").write_text("code of a later call\n")  # the next call's copy does not reach the job
    waited = job(root, env, "wait", "demo", "1")
    assert "demo still running after 1 s of waiting" in waited.stdout
    go.touch()
    waited = job(root, env, "wait", "demo", "30")
    assert "code of this call" in waited.stdout
    assert "demo ended: rc=3 wall_s=" in waited.stdout
    assert (tmp_path / "out" / "demo" / "exit").read_text().startswith("rc=3 ")
    assert (tmp_path / "out" / "demo" / "log").read_text() == f"code of this call\n{copy}\n"  # first on the path


def test_a_name_runs_once_per_machine(tmp_path):
    root = make_repository(tmp_path / "repo")
    env = environment(tmp_path)
    job(root, env, "start", "once", "true")
    job(root, env, "wait", "once", "30")
    again = job(root, env, "start", "once", "true", check=False)
    assert again.returncode == 1 and "a job named once has already run on this machine" in again.stderr
    missing = job(root, env, "wait", "other", "1", check=False)
    assert missing.returncode == 1 and "no job named other was started" in missing.stderr


def test_collect_brings_the_small_files_and_the_export_in_parts_that_join(tmp_path):
    root = make_repository(tmp_path / "repo")
    run_dir = tmp_path / "runs" / "full"
    for name, size in [("eval/summary.json", 50), ("config.yaml", 20), ("checkpoints/step_10/model.pt", 4000),
                       ("data/journal.jsonl", 3000), ("feature_cache/x.safetensors", 3000)]:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(os.urandom(size))
    export = {"export_best/model.safetensors": os.urandom(2500), "export_best/config.json": b"{}",
              "export/done.json": b'{"fingerprint": "a"}', "checkpoints/settings.json": b'{"command": []}'}
    for name, data in export.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    env = {**environment(tmp_path), "COLLECT_EXPORT": "1", "PART_BYTES": "1000"}
    job(root, env, "start", "full", "true")
    job(root, env, "wait", "full", "30", str(run_dir))
    out = tmp_path / "out" / "full"
    with tarfile.open(out / "run.tar.gz") as packed:
        names = {member.name for member in packed.getmembers() if member.isfile()}
    assert names == {"full/eval/summary.json", "full/config.yaml"}
    parts = sorted(out.glob("export_best.tar.part*"))
    assert len(parts) >= 3 and all(part.stat().st_size <= 1000 for part in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(part.read_bytes() for part in parts))) as joined:
        files = {member.name: joined.extractfile(member).read() for member in joined.getmembers() if member.isfile()}
    assert files == export


def test_a_killed_job_a_relative_run_folder_and_a_run_still_writing(tmp_path):
    root = make_repository(tmp_path / "repo")
    env = environment(tmp_path)
    # Writes into runs/live (relative: the job's own copy) without end until killed.
    job(root, env, "start", "writer", "bash", "-c",
        "mkdir -p runs/live; while true; do date >> runs/live/metrics.jsonl; sleep 0.01; done")
    waited = job(root, env, "wait", "writer", "1", "runs/live")
    assert "writer still running after 1 s of waiting" in waited.stdout
    with tarfile.open(tmp_path / "out" / "writer" / "run.tar.gz") as packed:
        assert "live/metrics.jsonl" in packed.getnames()  # a file growing under tar is no failure
    os.killpg(int((tmp_path / "jobs" / "writer" / "pid").read_text()), 9)  # its session: the loop too
    waited = job(root, env, "wait", "writer", "30", "runs/missing")
    assert "writer ended without an exit record" in waited.stdout
    assert "no run folder" in waited.stderr and str(tmp_path / "jobs" / "writer" / "repo" / "runs" / "missing") \
        in waited.stderr
    for bad in ("", "../x", "a/b"):
        refused = job(root, env, "start", bad, "true", check=False)
        assert refused.returncode == 2 and "a job name is one plain word" in refused.stderr


@pytest.mark.slow
def test_a_drafter_brought_back_in_parts_is_evaluated_in_the_unpacked_run_folder(tmp_path):
    """What the GPU plans bring back (run.tar.gz and export_best in parts) is a run folder `python -m dflash.eval`
    measures on another machine: the parts held the drafter without the export stage's mark, and the evaluation
    found no drafter of its settings."""
    root = make_repository(tmp_path / "repo")
    run_dir = tmp_path / "runs" / "full"
    settings = ["+experiment=tiny", "train.eval_every=5", "data.heldout=4"]
    python = [sys.executable, "-m"]
    subprocess.run([*python, "dflash.train", *settings, f"run_dir={run_dir}", "stages=[data,capture,train,export]"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    env = {**environment(tmp_path), "COLLECT_EXPORT": "1"}
    job(root, env, "start", "full", "true")
    job(root, env, "wait", "full", "30", str(run_dir))
    here = tmp_path / "here"
    here.mkdir()
    out = tmp_path / "out" / "full"
    with tarfile.open(out / "run.tar.gz") as packed:
        packed.extractall(here, filter="data")
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in sorted(out.glob("export_best.tar.part*"))))) \
            as joined:
        joined.extractall(here / "full", filter="data")
    assert not (here / "full" / "checkpoints" / "latest").exists()  # no weights but the export's
    # The folder alone: the training command's overrides come from checkpoints/settings.json.
    done = subprocess.run([*python, "dflash.eval", f"run_dir={here / 'full'}", "eval.mode=live",
                           "eval.prompt_sets.mtbench.limit=1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"the drafter of {here / 'full'}, with its training command's overrides: {' '.join(settings)}" \
        in done.stdout
    assert f"[eval] drafter {here / 'full' / 'export_best'}\n" in done.stdout  # the best held-out one, as trained
    assert json.loads((here / "full" / "eval" / "summary.json").read_text())["mode"] == "live"
    # export/ came back with its mark alone: not offered, and not evaluated in its place.
    assert f"drafter (z-lab format)      {here / 'full' / 'export_best'} (the best" in done.stdout
    assert "final weights" not in done.stdout
    final = subprocess.run([*python, "dflash.eval", f"run_dir={here / 'full'}", "eval.checkpoint=final"], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert final.returncode != 0 and "export holds no drafter (no config.json)" in final.stderr, final.stderr[-2000:]
