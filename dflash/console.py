"""A command's console output, copied as it is printed to a log file in the run folder."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO


class Tee:
    """A text stream that writes to the console stream it replaces and to a log file."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        if "\r" not in text:  # a progress bar redrawing itself: the console shows it, the log keeps the lines
            self.log.write(text)
        return self.console.write(text)

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
    """Inside, everything this process prints to stdout and stderr also goes to `path` (appended)."""
    global _current_log
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8", buffering=1) as log:
        out, err, outer = sys.stdout, sys.stderr, _current_log
        sys.stdout, sys.stderr, _current_log = Tee(out, log), Tee(err, log), log
        try:
            yield
        finally:
            sys.stdout, sys.stderr, _current_log = out, err, outer
