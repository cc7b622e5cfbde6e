"""bench/multi_gpu.py --dry-run lists the commands of its four parts (issue 22's prepared run) and runs none."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_lists_the_four_parts_commands(tmp_path):
    out = subprocess.run([sys.executable, "bench/multi_gpu.py", "--dry-run", "--gpus", "8", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    for part in (1, 2, 3, 4):
        assert f"part {part}: results under {tmp_path / f'part{part}'}" in out
    for zero in (1, 2, 3):
        for gpus in (1, 2, 6):
            assert f"[zero{zero}-gpus{gpus}," in out
    assert "--nproc_per_node 6 bench/train_step.py --only flex --zero-stage 3" in out
    assert "CUDA_VISIBLE_DEVICES=0 python bench/capture.py" in out and "CUDA_VISIBLE_DEVICES=1 python" in out
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 python -m torch.distributed.run" in out
    assert "launch/one_node.sh +experiment=smollm2 'train.devices=[0,1,2,3,4,5,6,7]'" in out
    for point in ("none", "trainer", "capture"):
        assert f"--max-restarts 1 tests/online_ranks_child.py {point} +experiment=tiny" in out
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
