"""Where code run in a block made the host wait for the GPU, as torch's sync debug mode reports it (CUDA tests)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def host_waits() -> Iterator[list[str]]:
    """Yields a list that, once the block has run, holds "file:line: message" for every synchronising CUDA call the
    block made (the GPU is drained first, so nothing queued before the block counts)."""
    torch.cuda.synchronize()
    waits: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # The mode's own notice ("... is a prototype ... synchronizing operations", once a process) is not a wait.
    waits.extend(f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                 if "called a synchronizing CUDA operation" in str(w.message))


def ours(waits: list[str]) -> list[str]:
    """The waits made by dflash's own code (a target's modeling code may wait, which is not ours to change)."""
    return [wait for wait in waits if "/dflash/" in wait.split(":")[0]]
