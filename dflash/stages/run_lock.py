"""One dflash command at a time in a run folder: an advisory lock on the folder itself (flock of its directory).

Two commands in one folder (a second terminal, an evaluation started while the training runs) used to interleave
their writes: one crashed midway, checkpoints of two settings shared the folder, and the evaluation read a drafter
half-made. The command's rank 0 holds the lock while it runs, and the kernel releases it however the process ends,
a kill -9 included, so a lock is never left stale. Nothing is written into the folder for it: a refused command
leaves the folder byte for byte as it was. A file system that takes no lock (some network ones) runs unlocked.
"""

from __future__ import annotations

import fcntl
import os

from dflash.config.errors import RunFolderError


class RunFolderLock:
    """The lock on `run_dir`, held from `take` until `release` (or the process's end)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.fd: int | None = None

    def take(self) -> None:
        """Hold the folder's lock (again a no-op while held); RunFolderError naming the holder when another process
        holds it."""
        if self.fd is not None:
            return
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY)  # not inherited: a child never holds the lock
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderError(f"run_dir={self.run_dir}: another dflash command is working in it"
                                 f"{holder(self.run_dir)}; wait for it to end (or stop it), or give this command "
                                 f"another run_dir") from None
        except OSError:  # no locks on this file system
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holder(run_dir: str) -> str:
    """' (pid 123: python -m dflash.train ...)' for the process the kernel lists as holding a lock on `run_dir`
    (/proc/locks, Linux), else ''."""
    try:
        inode = os.stat(run_dir).st_ino
        with open("/proc/locks", encoding="ascii") as f:
            pids = [int(fields[4]) for fields in (line.split() for line in f)
                    if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode)]
        pid = next(p for p in pids if p != os.getpid())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = " ".join(part.decode(errors="replace") for part in f.read().split(b"\0") if part)
    except (OSError, ValueError, StopIteration):
        return ""
    return f" (pid {pid}: {command[:200]})"
