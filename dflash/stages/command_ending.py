"""What a command shows, and writes to its run's log, for the error that ends it: a stop's line, a user error's one
line (the traceback with HYDRA_FULL_ERROR=1), else the traceback."""

from __future__ import annotations

import os
import traceback

from dflash.config import ConfigError


def full_error() -> bool:
    """Whether a user error shows its traceback (HYDRA_FULL_ERROR=1) rather than one line."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def ending(error: BaseException) -> str:
    """The text that ends a command for `error`."""
    from dflash.train.divergence import TrainingDiverged
    from dflash.train.stop_signal import CaptureStopped, TrainingStopped

    if isinstance(error, TrainingStopped):
        return f"[train] {error}\n"
    if isinstance(error, CaptureStopped):
        return f"[online] {error}\n"
    if isinstance(error, (ConfigError, TrainingDiverged)) and not full_error():
        return f"dflash: error: {error}\n"
    return "".join(traceback.format_exception(error))


# The exit status of a process ended by SIGTERM: not done, resumable.
STOPPED = 128 + 15


def ending_status(error: BaseException) -> int | None:
    """The exit status of a command that `error` ends without a traceback: a user error 2, divergence 1, a stop on a
    signal 143 (not done, resumable); None for the others."""
    from dflash.train.divergence import TrainingDiverged
    from dflash.train.stop_signal import CaptureStopped, TrainingStopped

    if isinstance(error, ConfigError):
        return 2
    if isinstance(error, TrainingDiverged):
        return 1
    if isinstance(error, (TrainingStopped, CaptureStopped)):
        return STOPPED
    return None
