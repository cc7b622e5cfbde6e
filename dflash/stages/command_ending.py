"""What a command shows, and writes to its run's log, for the error that ends it: a stop's line, Ctrl-C's line, a user
error's one line (the traceback with HYDRA_FULL_ERROR=1), else the traceback."""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from typing import NamedTuple

from dflash.config import ConfigError


def full_error() -> bool:
    """Whether a user error shows its traceback (HYDRA_FULL_ERROR=1) rather than one line."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


# The exit status of a process ended by SIGTERM: not done, resumable.
STOPPED = 128 + 15
# The exit status of a command interrupted by Ctrl-C (SIGINT), as a shell reports one killed by it.
INTERRUPTED = 128 + 2
INTERRUPTED_LINE = ("dflash: interrupted (Ctrl-C): rerun the same command to resume; finished stages are kept, and "
                    "so is what the stage in progress had saved")


class Terminated(KeyboardInterrupt):
    """SIGTERM outside training (which saves its step and ends with TrainingStopped), e.g. `timeout` or a
    scheduler's stop during the data stage or an evaluation: the command unwinds as on Ctrl-C, each stage keeping
    what it had saved, says so and ends with status 143."""

    signal_name = "SIGTERM"


def _terminate(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM")


class TerminationLine:
    """While active (a context manager, in the main thread of a single-process command only), SIGTERM raises
    Terminated, where nobody else handles it (a handler set before, by a launcher or a test, is left alone);
    training's StopSignal takes it over while it runs. A rank of a multi-process job keeps SIGTERM's default: a
    Python handler runs only between interpreter steps, so a rank waiting in a collective (the ranks past the
    first wait in barriers through the data and eval stages) would outlive its launcher's stop until its peers
    exit."""

    def __enter__(self) -> "TerminationLine":
        self.previous = None
        if threading.current_thread() is threading.main_thread() and int(os.environ.get("WORLD_SIZE", "1")) == 1 \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self.previous = signal.signal(signal.SIGTERM, _terminate)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class _Ending(NamedTuple):
    """How an error of `kind` ends a command without a traceback: its one line's prefix, the exit status, and
    whether HYDRA_FULL_ERROR=1 shows its traceback instead."""

    kind: type[BaseException]
    prefix: str
    status: int
    traceback_on_request: bool


def _ending_of(error: BaseException) -> _Ending | None:
    from dflash.train.divergence import TrainingDiverged
    from dflash.train.stop_signal import CaptureStopped, TrainingStopped

    endings = (_Ending(TrainingStopped, "[train] ", STOPPED, False),
               _Ending(CaptureStopped, "[online] ", STOPPED, False),
               _Ending(KeyboardInterrupt, "", INTERRUPTED, True),
               _Ending(ConfigError, "dflash: error: ", 2, True),
               _Ending(TrainingDiverged, "dflash: error: ", 1, True))
    return next((e for e in endings if isinstance(error, e.kind)), None)


def ending(error: BaseException) -> str:
    """The text that ends a command for `error`: a stop's line, a user error's or divergence's one line (the
    traceback with HYDRA_FULL_ERROR=1), else the traceback."""
    known = _ending_of(error)
    if known is None or (known.traceback_on_request and full_error()):
        return "".join(traceback.format_exception(error))
    if isinstance(error, Terminated):
        return f"{INTERRUPTED_LINE.replace('(Ctrl-C)', '(SIGTERM)')}\n"
    if isinstance(error, KeyboardInterrupt):
        return f"{INTERRUPTED_LINE}\n"
    return f"{known.prefix}{error}\n"


def ending_status(error: BaseException) -> int | None:
    """The exit status of a command that `error` ends without a traceback: a user error 2, divergence 1, a stop on
    SIGTERM or SIGUSR1 143, on Ctrl-C 130 (both: not done, resumable); None for the others."""
    known = _ending_of(error)
    if known is None:
        return None
    if getattr(error, "signal_name", None) == "SIGINT":
        return INTERRUPTED
    if isinstance(error, Terminated):
        return STOPPED
    return known.status


def exit_command(status: int) -> None:
    """End the process with `status`; a command interrupted by Ctrl-C (130) dies of SIGINT instead, as an
    interrupted program does, so that a shell loop or a `cmd1; cmd2` chain running it stops too (a shell goes on
    after a child that merely exited 130). The shell still reports 130; atexit handlers do not run then (the run's
    log is closed before, dflash/console.py)."""
    if status != INTERRUPTED or threading.current_thread() is not threading.main_thread():
        sys.exit(status)  # only the main thread may set a signal's handler
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit(status)  # where the signal is not delivered at once
