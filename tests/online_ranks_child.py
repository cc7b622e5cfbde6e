"""One rank of the torchrun jobs of tests/test_online_ranks.py: runs the command's pipeline; in the job's first start
the rank named by `point` SIGKILLs itself mid-run (after writing a marker, so the test knows it happened).

    python -m torch.distributed.run --nproc_per_node N --max-restarts 1 tests/online_ranks_child.py POINT OVERRIDES...

POINT: none | capture (the first capture rank, after sending its 2nd micro-batch: inside the first epoch, the only one
captured when the feature cache is on) | trainer (trainer rank 0, after the backward of its 7th micro-batch: in the
second epoch, read from the feature cache when it is on).
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import compose  # noqa: E402
from dflash.pipeline import run_command  # noqa: E402


def die_after(cls, name: str, when) -> None:
    """SIGKILL this process once `when(self)` holds after a call of cls.name."""
    real = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        if when(self):
            run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_dir="))
            Path(run_dir, f"killed-{os.environ['RANK']}").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(cls, name, wrapped)


def arm(point: str) -> None:
    from dflash.extract.capture_sender import CaptureSender
    from dflash.train.engine import TrainEngine

    calls = []
    if point == "capture":
        die_after(CaptureSender, "_send", lambda sender: sender.link.capture_index == 0 and sender.units_sent == 2)
    elif point == "trainer":
        die_after(TrainEngine, "backward", lambda _: os.environ["RANK"] == "0" and len(calls.append(1) or calls) == 7)


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        arm(sys.argv[1])
    run_command(compose(sys.argv[2:]))
