"""launch/one_node.sh on CPU: data, capture by two torchrun processes, training, eval, in one run folder."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def one_node(*overrides: str, dry_run: bool = False) -> subprocess.CompletedProcess:
    env = {**ENV, "DRY_RUN": "1"} if dry_run else ENV
    return subprocess.run(["bash", str(REPO / "launch" / "one_node.sh"), "+experiment=tiny", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.multiproc
@pytest.mark.slow
def test_one_node_script_captures_with_one_process_per_capture_worker(tmp_path):
    run_dir = tmp_path / "run"
    # Four (fake) capture GPUs, two per worker: two capture processes.
    done = one_node(f"run_dir={run_dir}", "show_progress=false", "capture.devices=[0,1,2,3]",
                    "capture.gpus_per_worker=2", "capture.shard_tokens=400", "logging.tensorboard=false")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 of 2" in done.stdout and "rank 1 of 2" in done.stdout  # both capture processes took shards
    manifest = json.loads((run_dir / "features" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 2
    assert json.loads((run_dir / "eval" / "summary.json").read_text())["overall"]["tau"] >= 1.0


def commands(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("+ env ")]


@pytest.mark.slow
def test_dry_run_gives_each_capture_worker_its_gpus():
    data, capture, train, evaluate = commands(one_node("capture.devices=[0,1,2,3]", "capture.gpus_per_worker=2",
                                                       "train.devices=[4,5,6,7]", dry_run=True))
    # data and eval load the target like capture worker 0 (layer-wise over its two GPUs).
    assert data.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 python -m dflash.train") and "stages=[data]" in data
    assert capture.startswith("+ env CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --standalone --nproc_per_node 2 ")
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun --standalone --nproc_per_node 4 ")
    assert evaluate.startswith("+ env CUDA_VISIBLE_DEVICES=0,1 python") and "stages=[eval]" in evaluate
    # One GPU per worker (the default): one capture process per GPU, as before.
    _, capture, _, evaluate = commands(one_node("capture.devices=[2,3]", dry_run=True))
    assert capture.startswith("+ env CUDA_VISIBLE_DEVICES=2,3 torchrun --standalone --nproc_per_node 2 ")
    assert evaluate.startswith("+ env CUDA_VISIBLE_DEVICES=2 python")


@pytest.mark.slow
def test_dry_run_of_online_capture_over_ranks_is_one_job_of_trainer_then_capture_gpus():
    _, _, train, _ = commands(one_node("capture=online", "capture.transport=ranks", "capture.devices=[0,1]",
                                       "train.devices=[2,3,4]", dry_run=True))
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=2,3,4,0,1 torchrun --standalone --nproc_per_node 5 "
                            "--max-restarts 3 ")
    assert "capture.ranks=2" in train and "stages=[train]" in train
    # A target over two GPUs per capture worker: one capture rank per worker, after the three trainer ranks.
    _, _, train, _ = commands(one_node("capture=online", "capture.transport=ranks", "capture.devices=[0,1,2,3]",
                                       "capture.gpus_per_worker=2", "train.devices=[4,5,6]", dry_run=True))
    assert train.startswith("+ env CUDA_VISIBLE_DEVICES=4,5,6,0,1,2,3 torchrun --standalone --nproc_per_node 5 ")
    assert "capture.ranks=2" in train and "capture.gpus_per_worker=2" in train


def test_gpus_per_worker_must_divide_the_capture_gpus():
    done = one_node("capture.devices=[0,1,2]", "capture.gpus_per_worker=2", dry_run=True)
    assert done.returncode != 0 and "does not divide the 3 capture GPU" in done.stderr
    assert "+ env" not in done.stdout
