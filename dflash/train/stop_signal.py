"""Stop cleanly when asked: SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) lets the trainer save a checkpoint at the next
step, then exit; a second Ctrl-C stops at once (KeyboardInterrupt), keeping the last periodic checkpoint.

Schedulers (SLURM before a time limit or preemption, Kubernetes, `timeout`) send SIGTERM and kill a little later.
Without a handler that is a SIGKILL in slow motion: the work since the last periodic checkpoint is lost. With it,
the step in flight finishes, every rank saves the same step, and rerunning the same command resumes there. The
capture ranks of capture=online (dflash/stages/capture_role.py) catch the same signals and keep serving the
trainers until these have stopped, then end in CaptureStopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CTRL_C_NOTE = "Ctrl-C: stopping after this step, which is saved (the same command resumes there); Ctrl-C again stops " \
              "at once"


class TrainingStopped(Exception):
    """Training stopped on a signal after saving the checkpoint of `step`; rerun the same command to resume."""

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(f"training stopped by {signal_name} after step {step}; a checkpoint of step {step} was "
                         "saved: rerun the same command to resume")
        self.step = step
        self.signal_name = signal_name


class CaptureStopped(Exception):
    """A capture rank of capture=online stopped on a signal once the trainer ranks it serves had stopped (they stop on
    the same signal, saving a checkpoint); rerun the same command to resume."""

    def __init__(self, rank: int, signal_name: str, how: str) -> None:
        super().__init__(f"capture rank {rank} stopped by {signal_name} once the trainer ranks had stopped ({how}): "
                         "they save a checkpoint when they stop on a signal; rerun the same command to resume")
        self.signal_name = signal_name


class StopSignal:
    """Catches SIGTERM, SIGUSR1 and SIGINT while active (a context manager); `requested()` agrees across ranks.

    Handlers can only be installed from the main thread; elsewhere (a trainer started from a thread) the signals
    keep their default meaning. A SIGINT the process was started ignoring (`nohup cmd &`, a background job of a
    script) stays ignored: a Ctrl-C meant for the script must not stop this run. `ctrl_c_note`: the line rank 0
    shows on the first Ctrl-C (None: none, for the capture ranks, which save nothing).
    """

    def __init__(self, ctrl_c_note: str | None = CTRL_C_NOTE) -> None:
        self.received: str | None = None
        self.ctrl_c_note = ctrl_c_note if os.environ.get("RANK", "0") == "0" else None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.received == "SIGINT":
                raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step
            if self.ctrl_c_note is not None:
                try:
                    print(f"\n{self.ctrl_c_note}", file=sys.stderr, flush=True)
                except RuntimeError:
                    pass  # the signal came in the middle of a write to stderr, which Python does not re-enter
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self, device: torch.device) -> bool:
        """True on every rank once any rank received a signal, so that all ranks save the same step."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received is not None  # one rank: no device round trip on every step
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stopped(self, step: int) -> TrainingStopped:
        """The error that ends training after the checkpoint of `step`, naming the signal this rank received."""
        return TrainingStopped(step, self.received or "a signal on another rank")
