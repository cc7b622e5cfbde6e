"""A command's console output, copied as it is printed to a log file in the run folder, and the package's messages.

dflash's modules report through `logging` (`logging.getLogger(__name__)`, under the "dflash" logger): the records
are written as their bare message to the current stdout (warnings and errors to stderr), so the console copy below
keeps them in the run's log file, and records below WARNING are shown by rank 0 only (RankZero). Progress bars,
the stage headers and a run's closing block are printed as they are.

A progress bar (tqdm redraws its line in place with '\\r') reaches the log file as one line, its last state, and a
console that is not a terminal (piped through tee, redirected, nohup) as a line every PIPED_BAR_EVERY seconds and
its last state: raw redraws there would pile up into one line of tens of thousands of characters.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from tqdm import tqdm

PIPED_BAR_EVERY = 30.0  # seconds between a progress bar's lines on a console that is not a terminal
# Where a tqdm bar's times begin: "[00:30<01:10, ...]" (or "[1:02:03...").
_BAR_TIMES = re.compile(r" ?\[\d+:\d\d")


def progress_of(bar: str) -> str:
    """What a tqdm bar's line says of its progress: the text before its times (description, share, bar, counts),
    without the times and rates that change with every redraw; the whole line when it shows no times."""
    return _BAR_TIMES.split(bar, maxsplit=1)[0]


class Tee:
    """A text stream that writes to the console stream it replaces and to a log file; a progress bar reaches the log
    as one line, and a console that is not a terminal as a line now and then (module docstring)."""

    def __init__(self, console: TextIO, log: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.log, self.clock = console, log, clock
        self.piped = not console.isatty()
        self.bar: str | None = None  # the state of the bar the last write drew ('' once cleared); None after text
        self.bar_shown_at: float | None = None  # when the bar in progress began or last went to a piped console
        self.bar_shown = ""  # the bar's state that last went to a piped console as a line
        self.bar_since = ""  # the bar's progress (progress_of) when it began or last went there

    def write(self, text: str) -> int:
        if text.startswith("\r"):  # tqdm draws, clears and closes a bar so; other text may hold a '\r' (CRLF)
            return self.redraw(text)
        shown = text
        if self.bar and text.startswith("\n"):  # tqdm ending a bar it leaves: the bar's state stays as a line
            self.log.write(self.bar)
            if self.piped and self.bar_shown and progress_of(self.bar) == progress_of(self.bar_shown):
                shown = text[1:]  # the piped console has that line already (the times after it aside)
            elif self.piped:
                self.console.write(self.bar)
            self.bar_shown_at, self.bar_shown = None, ""
        if text:
            self.bar = None
        self.log.write(text)
        self.console.write(shown)
        return len(text)

    def redraw(self, text: str) -> int:
        """A progress bar drawn again: its state is what follows the last '\\r' ('' when tqdm clears it)."""
        self.bar = text.rsplit("\r", 1)[1].rstrip()
        if not self.piped:
            return self.console.write(text)
        now = self.clock()
        if self.bar and self.bar_shown_at is None:
            self.bar_shown_at, self.bar_since = now, progress_of(self.bar)
        elif self.bar and now - self.bar_shown_at >= PIPED_BAR_EVERY and progress_of(self.bar) != self.bar_since:
            self.console.write(self.bar + "\n")  # (a bar that has not moved since its last line says nothing new)
            self.bar_shown_at, self.bar_shown, self.bar_since = now, self.bar, progress_of(self.bar)
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.console.flush()

    def isatty(self) -> bool:  # progress bars draw as they would on the console itself
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    def __getattr__(self, name: str):
        return getattr(self.console, name)


_current_log: TextIO | None = None


def run_log() -> TextIO | None:
    """The log file the console is being copied to (console_copied_to), or None outside one."""
    return _current_log


@contextlib.contextmanager
def console_copied_to(path: str) -> Iterator[None]:
    """Inside, everything this process prints to stdout and stderr also goes to `path` (appended), and so do the
    package's log records; they reach the console through PACKAGE_LOGGER's own handler only (a handler Hydra puts
    on the root logger would show them a second time, uncopied)."""
    global _current_log
    os.makedirs(os.path.dirname(path), exist_ok=True)
    package = logging.getLogger(PACKAGE_LOGGER)
    with open(path, "a", encoding="utf-8", buffering=1) as log:
        out, err, outer, propagate = sys.stdout, sys.stderr, _current_log, package.propagate
        sys.stdout, sys.stderr, _current_log = Tee(out, log), Tee(err, log), log
        package.propagate = False
        try:
            yield
        finally:
            sys.stdout, sys.stderr, _current_log = out, err, outer
            package.propagate = propagate


PACKAGE_LOGGER = "dflash"
# `logger.info(..., extra=EVERY_RANK)`: a message about this rank's own work, shown by every rank.
EVERY_RANK = {"every_rank": True}


class RankZero(logging.Filter):
    """Passes warnings and errors from every rank, other records from rank 0 only (the launcher's RANK), unless
    they are marked EVERY_RANK."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(record, "every_rank", False) or \
            os.environ.get("RANK", "0") == "0"


class ConsoleHandler(logging.StreamHandler):
    """Writes a record's message to the stdout of the moment (warnings and errors: stderr), so that a console being
    copied (console_copied_to) or captured (tests) receives it as it receives what is printed."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(RankZero())

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        # Clears the bars drawn on this console (stdout and stderr count as one) and draws them again after: the
        # record gets a line of its own instead of ending a bar's line.
        with tqdm.external_write_mode(file=self.stream):
            super().emit(record)


def show_package_messages() -> None:
    """Give PACKAGE_LOGGER its ConsoleHandler (once) at level INFO: the package's messages reach the console in
    every process, whoever configured logging or none."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if not any(isinstance(handler, ConsoleHandler) for handler in package.handlers):
        package.addHandler(ConsoleHandler())
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


VERBOSE_ENV = "DFLASH_VERBOSE"


def verbose() -> bool:
    """Whether DFLASH_VERBOSE asks for third-party output (DeepSpeed's and Hydra's log records, other libraries'
    progress bars) on the console."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


@contextlib.contextmanager
def transformers_bars_hidden() -> Iterator[None]:
    """Inside, transformers' own progress bars (loading a checkpoint's weights, writing a converted one, converting
    a GGUF file) are hidden unless verbose(); as they were afterwards."""
    from transformers.utils import logging as hf_logging

    if verbose():
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    with contextlib.ExitStack() as restore:
        hf_logging.disable_progress_bar()
        if enabled:
            restore.callback(hf_logging.enable_progress_bar)
        # The GGUF conversion draws a plain tqdm bar of its module, which the switch above does not reach.
        gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
        if hasattr(gguf, "tqdm"):
            restore.callback(setattr, gguf, "tqdm", gguf.tqdm)
            gguf.tqdm = functools.partial(gguf.tqdm, disable=True)
        yield
