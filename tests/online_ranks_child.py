"""One rank of the torchrun jobs of tests/test_online_ranks.py: runs the command's pipeline; in the job's first start
the rank named by `point` SIGKILLs itself mid-run (after writing a marker, so the test knows it happened).

    python -m torch.distributed.run --nproc_per_node N --max-restarts 1 tests/online_ranks_child.py POINT OVERRIDES...

POINT: none | capture (the first capture rank, after sending its 2nd micro-batch: inside the first epoch, the only one
captured when the feature cache is on) | trainer (trainer rank 0, after the backward of its 7th micro-batch: in the
second epoch, read from the feature cache when it is on) | sigterm (no kill: the first capture rank before it sends
micro-batch HELD and trainer rank 0 before it takes it write held-capture and held-trainer and wait for a file `go`;
each rank's stop-signal handler writes signalled-RANK once it ran, RANK a trainer's among the trainers).
"""

import os
import signal
import sys
import time
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
    elif point == "sigterm":
        hold_at_held_unit()


HELD = 2  # the micro-batch both ranks wait at: with 1 trainer rank of 4 samples a step, the third step's


def marker(name: str) -> Path:
    return Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_dir=")), name)


def wait_for_go(held: str) -> None:
    marker(held).write_text("")
    while not marker("go").exists():
        time.sleep(0.05)  # in Python: a signal's handler runs here


def hold_at_held_unit() -> None:
    from dflash.extract.capture_sender import CaptureSender
    from dflash.extract.linked_source import LinkedFeatureSource
    from dflash.train.stop_signal import StopSignal

    send, take, handle = CaptureSender._send, LinkedFeatureSource._take, StopSignal._handle

    def held_send(self, u, *args, **kwargs):
        if u == HELD and self.link.capture_index == 0:
            wait_for_go("held-capture")
        return send(self, u, *args, **kwargs)

    def held_take(self, *args, **kwargs):
        if self.rank == 0 and self.credited and self.credited[0][0] == HELD and not marker("held-trainer").exists():
            wait_for_go("held-trainer")
        return take(self, *args, **kwargs)

    def handled(self, *args, **kwargs):
        handle(self, *args, **kwargs)
        marker(f"signalled-{os.environ['RANK']}").write_text("")
    CaptureSender._send, LinkedFeatureSource._take, StopSignal._handle = held_send, held_take, handled


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        arm(sys.argv[1])
    run_command(compose(sys.argv[2:]))
