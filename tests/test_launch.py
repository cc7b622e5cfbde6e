"""launch/one_node.sh on CPU: data, capture by two torchrun processes, training, eval, in one run folder."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
def test_one_node_script_captures_with_one_process_per_capture_device(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(REPO / "launch" / "one_node.sh"), "+experiment=tiny", f"run_dir={run_dir}", "show_progress=false",
         "capture.devices=[0,1]", "capture.shard_tokens=400", "logging.tensorboard=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 of 2" in done.stdout and "rank 1 of 2" in done.stdout  # both capture processes took shards
    manifest = json.loads((run_dir / "features" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 2
    assert json.loads((run_dir / "eval" / "summary.json").read_text())["overall"]["tau"] >= 1.0
