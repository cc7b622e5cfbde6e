"""Third-party chatter kept off the console: it goes to the run's log file, warnings and errors still to the console.

DeepSpeed logs through its own logger ("DeepSpeed", which has its own console handler), and while it starts the
process group it prints a line per op it builds and probes which ops the machine supports by compiling small test
programs through setuptools, which logs every compiler call at INFO (`gcc ... -laio ...`). None of that is for the
user of a run: below WARNING it goes to the run's log file (the file the console is copied to, run_dir/logs/, when
one is being written; otherwise nowhere). wandb starts silent: its own log is run_dir/wandb/*/logs/debug.log and
the figures of its end-of-run summary are in metrics.jsonl.

transformers' and datasets' progress bars (loading weights, converting a GGUF file, writing a checkpoint, saving a
dataset) are not drawn, whatever show_progress says: dflash's own lines and bars tell what is happening.

DFLASH_VERBOSE=1 leaves all of it on the console, as the libraries print it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

from dflash import console
from dflash.console import verbose

DEEPSPEED_LOGGER = "DeepSpeed"
FORMAT = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")


def run_log() -> TextIO | None:
    """The run's log file while the console is copied to one (dflash/console.py)."""
    return console.run_log()


class BelowWarningToRunLog(logging.Filter):
    """Passes warnings and errors on; writes a record below WARNING to the run's log file instead (unless verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or verbose():
            return True
        log = run_log()
        if log is not None:
            log.write(FORMAT.format(record) + "\n")
        return False


def quiet_deepspeed_logger() -> None:
    """Call before DeepSpeed is imported: its log records below WARNING, its import's included, go to the run's log
    file. A filter on the logger itself, which DeepSpeed creates with its own console handler when imported."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, BelowWarningToRunLog) for f in logger.filters):
        logger.addFilter(BelowWarningToRunLog())


def _console_handlers() -> list[logging.Handler]:
    """The root logger's handlers that write to a console (under Hydra, its stdout handler; log files excluded)."""
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


class RunLogOnly(io.TextIOBase):
    """A stdout that writes to the run's log file only, and nowhere without one; keeps it as `log`, as the stream
    that copies the console does."""

    def __init__(self, log: TextIO | None) -> None:
        self.log = log

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.log is not None:
            self.log.write(text)
        return len(text)

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()


def console_copy_of(stream: TextIO) -> TextIO | None:
    """sys.stdout or sys.stderr where it writes to `stream` and copies it to the run's log file (console_copied_to)."""
    return next((s for s in (sys.stdout, sys.stderr) if isinstance(s, console.Tee) and s.console is stream), None)


@contextlib.contextmanager
def third_party_records_to_run_log() -> Iterator[None]:
    """Inside, the log records below WARNING that reach a console handler of the root logger go to the run's log file
    instead. Those are third-party libraries' (datasets' "JAX version ... available", matplotlib's font cache): the
    package's own records have a console handler of their own (dflash/console.py). Warnings and errors still reach
    the console, and the run's log file with them."""
    quiet = BelowWarningToRunLog()
    with contextlib.ExitStack() as restore:
        for handler in _console_handlers():
            # Hydra's handler took the console before the copy began (console_copied_to): it writes through the copy.
            copy = console_copy_of(handler.stream)
            if copy is not None:
                restore.callback(handler.setStream, handler.setStream(copy))
            if not verbose():
                handler.addFilter(quiet)
                restore.callback(handler.removeFilter, quiet)
        yield


@contextlib.contextmanager
def to_run_log() -> Iterator[None]:
    """Inside, what is printed to stdout and the log records below WARNING that reach a console handler go to the
    run's log file; stderr, warnings and errors still reach the console. Wrap third-party calls only."""
    if verbose():
        yield
        return
    with third_party_records_to_run_log(), contextlib.redirect_stdout(RunLogOnly(run_log())):
        yield
